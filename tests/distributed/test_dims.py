import pytest

from shardwise.models.llama.spec import SPEC as LLAMA

from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.zero import chunk_rows


def dims(world, **parallel):
    cfg = load_config(overrides={f"parallel.{k}": v for k, v in parallel.items()})
    return ParallelDims.from_config(cfg.parallel, world)


def test_dp_fills_the_world_when_unset():
    assert dims(4).dp == 4 and dims(1).dp == 1
    assert dims(4, zero=3, dp_replicate=2).dp_shard == 2


def test_product_must_equal_the_world_size():
    with pytest.raises(ValueError, match=r"dp\*tp\*cp\*pp = 6\*1\*1\*1 = 6 but 4 processes were launched"):
        dims(4, dp=6)


def test_batch_must_split_over_ranks_and_micro_batches():
    cfg = load_config(overrides={"train.global_batch_size": 8, "train.micro_batch_size": 4})
    d = ParallelDims.from_config(cfg.parallel, 4)
    with pytest.raises(ValueError, match=r"train.global_batch_size = 8 is invalid: use a multiple of "
                                         r"train.micro_batch_size x dp = 4 x 4 = 16"):
        d.check_batch(cfg)
    assert ParallelDims.from_config(cfg.parallel, 2).num_micro_batches(cfg) == 1


def test_describe():
    assert dims(1).describe() == "1 process"
    assert dims(4, zero=1).describe() == "dp4 zero1"
    assert dims(4, zero=3, dp_replicate=2).describe() == "hsdp 2x2 zero3"


@pytest.mark.parametrize("rows, n", [(8, 2), (5, 4), (1, 4), (64, 3)])
def test_chunk_rows_cover_every_row_once_like_dtensor(rows, n):
    import torch

    bounds = [chunk_rows(rows, n, r) for r in range(n)]
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(rows))
    chunks = torch.arange(rows).chunk(n)  # DTensor Shard(0) cuts as torch.chunk does
    for r, (start, end) in enumerate(bounds):
        expected = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(start, end)) == expected


@pytest.mark.parametrize(
    "model, tp, sp, seq_len, message",
    [
        (dict(n_kv_heads=2), 4, False, 32, "model.n_kv_heads = 2 key/value heads cannot be split over 4 ranks"),
        (dict(n_kv_heads=4, ffn_dim=150), 4, False, 32, "model.ffn_dim = 150 does not divide by it"),
        (dict(n_kv_heads=4, vocab_size=9), 4, False, 32,
         r"model.vocab_size = 9 leaves a rank without vocabulary rows \(pieces of 3\); use a tp of at most 3"),
        (dict(n_heads=6, n_kv_heads=2, head_dim=16), 4, False, 32, "model.n_kv_heads = 2"),
        (dict(n_kv_heads=4), 4, True, 30, "train.seq_len = 30 is invalid: sequence parallelism splits each sequence over parallel.tp = 4 ranks"),
    ],
)
def test_tensor_parallel_degrees_that_do_not_fit_name_the_constraint(model, tp, sp, seq_len, message):
    from shardwise.core.layout_checks import check_tensor_parallel
    from shardwise.config.presets import model_config

    cfg = model_config("debug", **{"tie_embeddings": False, **model})
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(cfg, LLAMA, tp=tp, sp=sp, seq_len=seq_len)
    check_tensor_parallel(cfg, LLAMA, tp=1, sp=False, seq_len=seq_len)  # one rank always fits


@pytest.mark.parametrize("vocab_size, tp", [(510, 4), (50257, 2), (50257, 8), (30522, 4), (10, 4)])
def test_a_vocabulary_that_does_not_divide_splits_unevenly_over_tp(vocab_size, tp):
    """DTensor's Shard cuts the vocabulary as torch.chunk does (GPT-2's 50,257, BERT's 30,522):
    tp need not divide it, only leave every rank some rows (10 over 4: 3, 3, 3, 1)."""
    from shardwise.core.layout_checks import check_tensor_parallel
    from shardwise.config.presets import model_config

    check_tensor_parallel(model_config("debug", n_heads=8, n_kv_heads=8, ffn_dim=256, vocab_size=vocab_size),
                          LLAMA, tp=tp, sp=False, seq_len=32)
