"""The exit statuses of `shardwise` commands, in one place (docs/reliability.md lists them).

A scheduler or a wrapper script can act on them: rerun after PREEMPTED or STALLED (the rerun
resumes from the newest checkpoint), fix the input after BAD_INPUT, lower the learning rate
after NONFINITE. A rank killed by signal N with no restarts left ends the job with 128 + N.
"""

OK = 0
BAD_INPUT = 2
"""A one-line error named the field, the value and the fix; nothing was started or written."""
NONFINITE = 3
"""Training stopped on a non-finite loss or gradient (train.on_nonfinite); the update was not applied."""
PREEMPTED = 75
"""A pre-emption signal (train.preempt_signals) was answered with a checkpoint (sysexits' EX_TEMPFAIL)."""
STALLED = 124
"""No rank made progress for train.stall_timeout_s and no restart was left (as GNU `timeout`)."""
INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT), after saving the step in flight or, on a second Ctrl-C, at once: 128 + SIGINT,
what a shell reports for a process that Ctrl-C ended, so scripts treat both alike (not PREEMPTED: a
wrapper that reruns pre-empted jobs must not rerun one a person stopped)."""
NO_RESTART = (BAD_INPUT, NONFINITE, PREEMPTED, INTERRUPTED)
"""Failures a restart would only repeat (bad input, divergence) or undo (the machine is being taken, a person
stopped the run)."""
