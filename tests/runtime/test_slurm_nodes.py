"""`--nnodes auto`'s reading of Slurm's environment: the node list expanded as `scontrol show
hostnames` expands it, this node's rank and the head node, and one line for what is missing or wrong."""

from __future__ import annotations

import pytest

from shardwise.runtime.slurm_nodes import SlurmNodes, expand_nodelist, slurm_nodes


@pytest.mark.parametrize("text, names", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("login1,gpu[8-10]", ["login1", "gpu8", "gpu9", "gpu10"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[1,3],b2", ["a1", "a3", "b2"]),
])
def test_node_lists_expand_as_scontrol_does(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text, words", [
    ("node[01-04", "not closed"),
    ("node[[1]]", "do not pair up"),
    ("node[4-2]", "bad range '4-2'"),
    ("node[a-c]", "bad range 'a-c'"),
    ("", "names no node"),
])
def test_malformed_node_lists_are_one_line_naming_the_variable(text, words):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST") as error:
        expand_nodelist(text)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_job_environment_gives_count_rank_and_head():
    environ = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    assert slurm_nodes(environ) == SlurmNodes(nnodes=3, node_rank=2, head="gpu07")
    older = {"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "solo"}
    assert slurm_nodes(older).head == "solo"


@pytest.mark.parametrize("environ, words", [
    ({}, "--nnodes = auto is invalid here"),
    ({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NODEID is not set"),
    ({"SLURM_NNODES": "3", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}, "names 2 nodes"),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_NODEID = 2 is invalid"),
    ({"SLURM_NNODES": "two", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"}, "SLURM_NNODES = 'two' is invalid"),
])
def test_outside_slurm_or_with_an_inconsistent_environment_it_is_one_line(environ, words):
    with pytest.raises(ValueError) as error:
        slurm_nodes(environ)
    assert words in str(error.value) and "\n" not in str(error.value)
