"""`shardwise estimate`, `estimate --jsonl`, `plan` and hardware files, through the CLI."""

import json
import subprocess
import sys

import pytest

from shardwise.cli.main import main
from shardwise.planner.hardware import resolve_hardware

ESTIMATE_KEYS = {"fits", "peak_memory_gib", "memory_gib", "step_time_s", "tokens_per_s_per_device", "mfu", "time_s"}
NO_TORCH = "import sys; sys.modules['torch'] = None; from shardwise.cli.main import main; sys.exit(main(sys.argv[1:]))"


def run_cli(*argv, stdin=""):
    """The CLI in a fresh interpreter where importing torch fails: the planner must not need it."""
    return subprocess.run([sys.executable, "-c", NO_TORCH, *argv], input=stdin, capture_output=True, text=True, timeout=120)


def test_estimate_json_has_the_documented_keys(capsys):
    main(["estimate", "--model", "llama3-8b", "--layout", '{"dp": 8, "zero": 1, "grad_accum": 4}',
          "--hardware", "h100-80gb", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert ESTIMATE_KEYS <= set(result)
    assert isinstance(result["fits"], bool)
    assert result["peak_memory_gib"] == pytest.approx(sum(v for k, v in result["memory_gib"].items()
                                                          if k not in ("device", "reserved_by_runtime")))
    assert result["tokens_per_s_per_device"] > 0 and 0 < result["mfu"] < 1


def test_estimate_takes_an_hf_config_file(tmp_path, capsys):
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False,
              "num_local_experts": 8, "num_experts_per_tok": 2, "model_type": "mixtral"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    main(["estimate", "--model", str(path), "--layout", '{"dp": 8, "ep": 8, "zero": 3}', "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["num_params"] == 46_702_792_704  # Mixtral 8x7B
    assert result["time_s"]["ep_comm"] > 0


def test_jsonl_round_trip_without_torch():
    lines = [
        {"model": "llama3-8b", "layout": {"dp": 8, "zero": 3}, "hardware": "h100-80gb"},
        {"model": "llama3-70b", "layout": {"tp": 8, "pp": 4, "grad_accum": 8}, "hardware": "h200-141gb"},
        {"model": "llama3-8b", "layout": {"tp": 3}, "hardware": "h100-80gb"},
        "not json",
    ]
    stdin = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    done = run_cli("estimate", "--jsonl", stdin=stdin)
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(out) == 4
    assert ESTIMATE_KEYS <= set(out[0]) and ESTIMATE_KEYS <= set(out[1])
    assert out[2]["error"].startswith("layout.tp = 3 is invalid") and "not JSON" in out[3]["error"]


def test_plan_table_without_torch():
    done = run_cli("plan", "--model", "llama3-8b", "--devices", "16", "--hardware", "h100-80gb",
                   "--global-batch-tokens", "1048576", "--seq-len", "4096", "--top", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "layouts considered" in lines[0]
    rows = [line for line in lines if line[:3].strip().isdigit()]
    assert len(rows) == 3
    speeds = [float(row.split()[-9].replace(",", "")) for row in rows]
    assert all(later <= earlier * 1.001 for earlier, later in zip(speeds, speeds[1:]))
    assert " wins at " in lines[-1]


def test_plan_json_layouts_fit_and_are_sorted(capsys):
    main(["plan", "--model", "llama3-1b", "--devices", "8", "--global-batch-tokens", "262144", "--seq-len", "2048",
          "--top", "5", "--json"])
    result = json.loads(capsys.readouterr().out)
    layouts = result["layouts"]
    assert len(layouts) == 5 and all(r["fits"] for r in layouts)
    speeds = [r["tokens_per_s_per_device"] for r in layouts]
    assert all(later <= earlier * 1.001 for earlier, later in zip(speeds, speeds[1:]))  # near-ties: simpler first
    for r in layouts:
        layout = r["layout"]
        assert layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] == 8
        assert layout["dp"] * layout["micro_batch"] * layout["grad_accum"] * 2048 == 262144


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--model", "nope", "--layout", "{}"], "model = 'nope' is invalid"),
    (["estimate", "--model", "llama3-8b", "--layout", "{\"zero\": 5}"], "layout.zero = 5 is invalid"),
    (["estimate", "--model", "llama3-8b", "--layout", "{}", "--hardware", "tpu"], "hardware = 'tpu' is invalid"),
    (["estimate", "--model", "llama3-8b"], "--layout is missing"),
    (["plan", "--model", "llama3-8b", "--devices", "8", "--global-batch-tokens", "1000", "--seq-len", "4096"],
     "--global-batch-tokens = 1000 is invalid: use a multiple of --seq-len"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: ") and message in err and err.count("\n") == 1


def test_hardware_file_overrides_a_preset(tmp_path, capsys):
    path = tmp_path / "hw.toml"
    path.write_text('base = "h100-80gb"\nname = "slow-h100"\npeak_flops_bf16 = 494.5e12\n[inter]\nall_reduce = 1e9\n')
    hardware = resolve_hardware(str(path))
    preset = resolve_hardware("h100-80gb")
    assert hardware.peak_flops_bf16 == preset.peak_flops_bf16 / 2
    assert hardware.inter["all_reduce"] == 1e9 and hardware.inter["all_gather"] == preset.inter["all_gather"]
    slower = tmp_path / "hw.json"
    slower.write_text(json.dumps({"base": "h100-80gb", "peak_flops_bf16": 989e12 / 4}))
    layout = '{"dp": 16, "grad_accum": 2}'
    results = []
    for hardware in ("h100-80gb", str(path), str(slower)):
        main(["estimate", "--model", "llama3-1b", "--layout", layout, "--hardware", hardware, "--json"])
        results.append(json.loads(capsys.readouterr().out))
    fast, slow, slowest = results
    # compute = matmul FLOPs / rate + memory traffic / bandwidth: only the first term scales
    matmul = slow["time_s"]["compute"] - fast["time_s"]["compute"]
    assert matmul > 0 and slowest["time_s"]["compute"] - fast["time_s"]["compute"] == pytest.approx(3 * matmul)
    assert slow["time_s"]["dp_comm"] + slow["time_s"]["dp_comm_overlapped"] > \
        fast["time_s"]["dp_comm"] + fast["time_s"]["dp_comm_overlapped"]


def test_bad_hardware_file_names_the_field(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"base": "h100-80gb", "intra": {"all_reduce": -1}}))
    with pytest.raises(ValueError, match=r"hardware.intra.all_reduce = -1 is invalid"):
        resolve_hardware(str(path))
    path.write_text(json.dumps({"base": "h100-80gb", "flops": 1}))
    with pytest.raises(ValueError, match=r"hardware.flops is invalid: not a hardware field"):
        resolve_hardware(str(path))
