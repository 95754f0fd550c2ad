"""``hvdc bench tta``: the corpus split, the bits-per-byte measure, the target logic, and a real
two-rank run on shared memory that resumes without redoing a finished run."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from horovod_compress.tools.bench import tta
from horovod_compress.tools.bench.tta_task import (MODELS, VAL_EVERY, bits_per_byte, build_gpt, corpus_files,
                                             model_config, parameter_count, read_bytes, stdlib_root, train_batch,
                                             validation_windows)
from horovod_compress.tools.testing import mpi_env


def test_split_is_by_file_deterministic_and_disjoint(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"pkg{i % 3}").mkdir(exist_ok=True)
        (tmp_path / f"pkg{i % 3}" / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third.py").write_text("y = 1\n")
    train, val = corpus_files(tmp_path)
    assert (train, val) == corpus_files(tmp_path)                       # deterministic
    rel = lambda files: {f.relative_to(tmp_path).as_posix() for f in files}  # noqa: E731
    assert rel(train).isdisjoint(rel(val)) and len(train) + len(val) == 40   # every file once, no third-party
    assert all(zlib.crc32(r.encode()) % VAL_EVERY == 0 for r in rel(val))
    assert all(zlib.crc32(r.encode()) % VAL_EVERY != 0 for r in rel(train))
    # the real corpus: the interpreter's standard library, about one file in ten held out
    train, val = corpus_files()
    assert train[0].is_relative_to(stdlib_root()) and 0.05 < len(val) / (len(train) + len(val)) < 0.15
    first = read_bytes(val[:3])
    assert bytes(first) == b"".join(f.read_bytes() + b"\n" for f in val[:3])


def test_batches_are_seeded_and_validation_windows_are_shared_out() -> None:
    data = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    cfg = MODELS["tiny"]
    x, y = train_batch(data, cfg, 0, 1, 5)
    assert torch.equal(x, train_batch(data, cfg, 0, 1, 5)[0])
    assert not torch.equal(x, train_batch(data, cfg, 0, 2, 5)[0])       # each rank its own windows
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (cfg.batch, cfg.seq)   # y is x shifted by one byte
    parts = [validation_windows(data, cfg, 10, r, 3)[0] for r in range(3)]
    assert sum(len(p) for p in parts) == 10
    whole = validation_windows(data, cfg, 10, 0, 1)[0]
    assert torch.equal(torch.cat(parts).sort(0).values, whole.sort(0).values)   # every window scored once


def test_bits_per_byte_is_cross_entropy_over_ln2() -> None:
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)
    torch.manual_seed(0)
    model = build_gpt("tiny")
    torch.nn.init.zeros_(model.head.weight)       # uniform over 256 bytes: exactly 8 bits per byte
    x = torch.randint(0, 256, (2, MODELS["tiny"].seq))
    with torch.no_grad():
        assert bits_per_byte(float(model.loss(x, x))) == pytest.approx(8.0, abs=1e-5)
    assert parameter_count(build_gpt("gpt")) >= 5_000_000


def _run(method: str, seed: int, times: list[float], steps: list[int], bpb: list[float], step_s: float,
         bw: str = "1gbit") -> dict:
    curve = [{"step": s, "time_s": t, "val_bpb": b} for s, t, b in zip(steps, times, bpb)]
    return {"method": method, "seed": seed, "hosts": 4, "bandwidth": bw, "curve": curve,
            "final_val_bpb": bpb[-1], "steps_run": steps[-1], "step_s": step_s}


def test_target_steps_to_target_and_ratios() -> None:
    runs = [_run("none", 0, [0, 4, 8], [0, 4, 8], [8.0, 5.0, 4.0], 1.0),
            _run("topk", 0, [0, 1, 2, 3], [0, 4, 8, 12], [8.0, 5.5, 4.5, 3.9], 0.25),   # 1.5x steps, 4x faster
            _run("fp16", 0, [0, 8, 16], [0, 4, 8], [8.0, 5.0, 4.0], 2.0),               # same steps, slower
            _run("randk", 0, [0, 3, 6, 9], [0, 4, 8, 12], [8.0, 6.0, 5.0, 4.5], 0.75),  # never reaches 4.0
            _run("none", 1, [0, 5, 10], [0, 4, 8], [8.0, 5.0, 3.0], 1.25)]
    table = {(r["method"], r["seed"]): r for r in tta.rows(runs)}
    assert tta.target_of(runs, 4, "1gbit", 0) == 4.0 and tta.target_of(runs, 4, "1gbit", 7) == 4.0
    dense = table[("none", 0)]
    assert (dense["steps_to_target"], dense["time_to_target_s"], dense["speedup_vs_dense"]) == (8, 8, 1.0)
    topk = table[("topk", 0)]
    assert topk["steps_to_target"] == 12 and topk["time_to_target_s"] == 3
    assert topk["speedup_vs_dense"] == pytest.approx(8 / 3)
    assert topk["steps_ratio"] == pytest.approx(1.5) and topk["step_time_ratio"] == pytest.approx(0.25)
    fp16 = table[("fp16", 0)]
    assert fp16["speedup_vs_dense"] == pytest.approx(0.5) and "fewer steps per second" in tta.reason(fp16)
    randk = table[("randk", 0)]
    assert randk["time_to_target_s"] is None and randk["speedup_vs_dense"] is None
    assert "more steps to the same loss" in tta.reason(randk)
    assert table[("none", 1)]["target_val_loss"] == 3.0                 # each seed against its own dense
    assert tta.fastest(tta.rows(runs), 4, "1gbit", 2) == ["topk", "fp16"]
    assert tta.first_at_or_below(runs[0]["curve"], 4.5) == {"step": 8, "time_s": 8, "val_bpb": 4.0}


def test_a_dense_seed_on_a_busier_machine_is_said_with_its_speedups_at_the_other_seeds_pace() -> None:
    runs = [_run("none", 0, [0, 4, 8], [0, 4, 8], [8.0, 5.0, 4.0], 1.0),
            _run("none", 1, [0, 6, 12], [0, 4, 8], [8.0, 5.0, 3.0], 1.5),    # same 8 steps, 1.5x slower
            _run("topk", 1, [0, 2, 4], [0, 4, 8], [8.0, 5.0, 3.0], 0.5)]
    table = tta.rows(runs)
    note = tta.dense_step_note(table)[1]
    assert note.startswith("Dense's seconds per step, by seed: seed 0 1.000 s, seed 1 1.500 s (the same work; 1.50x")
    # topk seed 1 took 4 s: 3x against its own dense (12 s), 2x at seed 0's pace (8 steps x 1 s)
    assert next(r for r in table if r["method"] == "topk")["speedup_vs_dense"] == pytest.approx(3.0)
    assert note.endswith("seed 1's speedups would read: topk 2.00x.")
    assert tta.dense_step_note(tta.rows(runs[:1])) == []                          # one seed: nothing to say
    calm = tta.dense_step_note(tta.rows([runs[0], dict(runs[1], step_s=1.1)]))[1]
    assert "busier" not in calm                                                   # within 20%: no warning


def test_batch_option_overrides_the_models_batch_only() -> None:
    assert model_config("gpt") == MODELS["gpt"] and MODELS["gpt"].batch == 1
    two = model_config("gpt", 2)
    assert two.batch == 2 and (two.width, two.layers, two.seq) == (MODELS["gpt"].width, MODELS["gpt"].layers,
                                                                   MODELS["gpt"].seq)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        model_config("gpt", 0)
    assert "batch" in tta.RUN_KEY             # runs with another batch are not taken for done


def test_unknown_methods_are_skipped_and_dense_comes_first() -> None:
    kept, unknown = tta.known_methods("topk,no_such_method,none")
    assert kept == ["none", "topk"] and unknown == ["no_such_method"]


def _cli(out: Path, methods: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "horovod_compress.tools.cli", "bench", "tta", "--no-cluster", "--hosts", "2",
           "--model", "tiny", "--batch", "2", "--steps", "4", "--eval-every", "2", "--seeds", "0", "--val-windows", "8",
           "--train-bytes", "200000", "--methods", methods, "--out", str(out), "--timeout", "150"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=mpi_env())


def test_two_ranks_on_shared_memory_resume_a_finished_dense_run(tmp_path: Path) -> None:
    # a finished dense run already in the results (as an interrupted study leaves it): the command
    # trains only topk, against that run's final loss, and keeps the dense record as it was
    dense = {**_run("none", 0, [0.0, 1.0, 2.0], [0, 2, 4], [8.3, 7.9, 7.7], 0.5, bw="shm"),
             "hosts": 2, "model": "tiny", "batch": 2, "dense_steps": 4, "lr": 0.002, "train_s": 2.0, "parameters": 82752,
             "eval_every": 2, "train_bytes": 200000, "val_bytes": 3_000_000, "files": [1500, 190],
             "threads_per_rank": 1}
    (tmp_path / "time_to_accuracy.json").write_text(json.dumps({"runs": [dense]}))
    proc = _cli(tmp_path, "none,topk")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert [r["method"] for r in after["runs"]] == ["none", "topk"] and after["runs"][0] == dense
    topk = after["runs"][1]
    assert topk["world_size"] == 2 and topk["target_bpb"] == 7.7 and topk["files"][1] > 0
    assert topk["batch"] == 2 and topk["seq"] == MODELS["tiny"].seq            # --batch reached the ranks
    assert topk["steps_run"] <= 6 and topk["curve"][0]["step"] == 0                 # 1.5x dense's budget
    assert 0 < topk["loading_s"] < 60                 # its kernels loaded before the clock, timed apart
    assert all(b["time_s"] > a["time_s"] for a, b in zip(topk["curve"], topk["curve"][1:]))
    assert topk["curve"][0]["val_bpb"] < 8.5                  # an untrained byte model: about 8 bits per byte
    reached = min(c["val_bpb"] for c in topk["curve"]) <= 7.7
    assert (topk["steps_run"] < 6 or reached) == reached       # stops at the target, else at the budget
    row = next(r for r in after["rows"] if r["method"] == "topk")
    assert set(row) >= {"method", "hosts", "bandwidth", "seed", "time_to_target_s", "steps_to_target",
                        "final_val_loss", "speedup_vs_dense"}
    assert (row["steps_to_target"] is not None) == reached
    md = (tmp_path / "time_to_accuracy.md").read_text()
    assert "| topk | 0 |" in md and "## P = 2, shm" in md
    for png in ("time_to_accuracy_time.png", "time_to_accuracy_steps.png"):
        assert (tmp_path / png).stat().st_size > 1000
