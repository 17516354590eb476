import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.model import build_drafter
from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.training.config import load_config
from sglang_hspec.training.data import patterned_examples
from sglang_hspec.training.trainer import (
    STATE_FILE,
    CheckpointWriteError,
    build_model,
    drafter_config,
    target_layer_map,
    train,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "train_tiny.yaml"
SMALL = ["data.synthetic.num_sequences=16", "data.synthetic.seq_len=24", "data.max_length=24",
         "data.batch_size=4", "data.num_anchors=4"]


def _fit_target_to_patterns(cfg, steps=60):
    """The tiny target, briefly trained on the patterned text so its next-token distributions are learnable."""
    torch.manual_seed(0)
    target = tiny_target("llama", **{k: v for k, v in cfg.model.target_kwargs.items() if k != "arch"})
    ids = torch.tensor([e["input_ids"] for e in patterned_examples(**cfg.data.synthetic.model_dump())])
    target.train().requires_grad_(True)
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = ids[torch.randint(0, len(ids), (24,), generator=g)]
        target(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return target.eval().requires_grad_(False)


@pytest.mark.slow
def test_training_on_patterned_text_lowers_loss_and_raises_tau(tmp_path):
    cfg = load_config(TINY, [f"training.output_dir={tmp_path}", "training.max_steps=50"])
    result = train(cfg, target=_fit_target_to_patterns(cfg), progress=False)
    h = result.history
    assert len(h) == 50
    assert h[0].tau_prob < 1.5 < h[-1].tau_prob
    first, last = sum(m.loss for m in h[:5]) / 5, sum(m.loss for m in h[-5:]) / 5
    assert last < 0.5 * first
    assert len(h[-1].accept) == cfg.model.block_size and h[-1].accept[0] > 0.8
    ckpt = Path(result.checkpoints[-1])
    assert (ckpt / "drafter" / "config.json").is_file() and (ckpt / "drafter" / "model.safetensors").is_file()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10, 20, 30, 40, 50]


def test_resume_gives_the_same_next_step_loss(tmp_path):
    over = SMALL + ["training.max_steps=4", "training.save_every=2"]
    full = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'a'}"]), progress=False)
    first = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'b'}", "training.max_steps=4"]),
                  progress=False)
    assert [m.loss for m in first.history] == [m.loss for m in full.history]
    resumed = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'b'}",
                                              f"training.resume_from={tmp_path / 'b' / 'checkpoint-2'}"]),
                    progress=False)
    assert [m.step for m in resumed.history] == [3, 4]
    assert [m.loss for m in resumed.history] == [m.loss for m in full.history[2:]]
    assert full.history[2].loss != full.history[1].loss  # the comparison is not vacuous
    # the same through "auto" (latest checkpoint in output_dir)
    auto = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'b'}", "training.resume_from=auto",
                                           "training.max_steps=4"]), progress=False)
    assert auto.history == []  # checkpoint-4 is the latest: nothing left to do


def test_stop_after_trains_a_slice_of_the_schedule_and_auto_resume_finishes_it(tmp_path):
    over = SMALL + ["training.max_steps=4", f"training.output_dir={tmp_path}"]
    full = train(load_config(TINY, SMALL + ["training.max_steps=4", f"training.output_dir={tmp_path / 'full'}"]),
                 progress=False)
    head = train(load_config(TINY, over + ["training.stop_after=3"]), progress=False)
    assert [m.step for m in head.history] == [1, 2, 3]
    assert head.checkpoints == [str(tmp_path / "checkpoint-3")]
    assert [m.lr for m in head.history] == [m.lr for m in full.history[:3]]  # the 4-step schedule, not a 3-step one
    tail = train(load_config(TINY, over + ["training.resume_from=auto"]), progress=False)
    assert [m.step for m in tail.history] == [4]
    assert tail.history[0].loss == full.history[3].loss


def test_init_from_a_drafter_directory_equals_init_from_its_training_checkpoint(tmp_path):
    # a shipped drafter is a bare drafter directory (config.json + model.safetensors): continuing from it
    # must load the same weights (draft vocabulary included) as continuing from the training checkpoint
    over = SMALL + ["training.max_steps=2"]
    first = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'a'}"]), progress=False)
    ckpt = Path(first.checkpoints[-1])
    runs = [train(load_config(TINY, over + [f"training.output_dir={tmp_path / name}", f"model.init_from={src}"]),
                  progress=False) for name, src in (("b", ckpt), ("c", ckpt / "drafter"))]
    assert [m.loss for m in runs[0].history] == [m.loss for m in runs[1].history]
    assert runs[0].history[0].loss != first.history[0].loss  # not a fresh drafter: the weights were loaded
    with pytest.raises(FileNotFoundError, match=r"model.init_from=.*nowhere: no checkpoint there"):
        train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'd'}",
                                        f"model.init_from={tmp_path / 'nowhere'}"]), progress=False)


def test_stop_after_outside_the_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="stop_after must be in"):
        load_config(TINY, SMALL + ["training.max_steps=4", "training.stop_after=5"])


def test_block_size_mismatch_with_checkpoint_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "checkpoint-7" / "drafter"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"block_size": 7}))
    cfg = load_config(TINY, SMALL + [f"model.init_from={ckpt.parent}"])
    with pytest.raises(ValueError, match=r"model.block_size=4 does not match the checkpoint .*block_size=7"):
        train(cfg, progress=False)


def test_layer_id_out_of_range_for_the_target_is_a_clear_error(tmp_path):
    cfg = load_config(TINY, SMALL + ["model.target_layer_ids=[0, 1, 2, 3, 5]", "model.kv_layer_ids=[]"])
    with pytest.raises(ValueError, match=r"\[5\] out of range for a 5-layer target"):
        train(cfg, progress=False)


def test_one_recipe_for_every_kind_still_builds_dflash_without_markov_and_confidence_heads():
    # every configs/train_*_smollm2.yaml shares model.drafter (markov_rank included); DFlash has neither head
    heads = {}
    for kind in ("dflash", "dspark", "hspec"):
        cfg = load_config(TINY, [f"model.kind={kind}"])
        target = tiny_target("llama", **{k: v for k, v in cfg.model.target_kwargs.items() if k != "arch"})
        drafter = build_drafter(kind, drafter_config(cfg, target), target.get_input_embeddings(),
                                target.get_output_embeddings())
        heads[kind] = (drafter.markov is not None, drafter.confidence is not None, drafter.config.markov_rank)
    assert heads == {"dflash": (False, False, 0), "dspark": (True, True, 32), "hspec": (True, True, 32)}


@pytest.mark.parametrize("kind", ["hspec", "dspark", "dflash", "dflash_target_kv", "hspec_kv_only",
                                  "hspec_last_token_only"])
def test_block_outputs_ignore_target_tokens_after_the_anchor(kind):
    """Slot j of anchor a may read tokens <= a+j (context, anchor, teacher-forced Markov previous token);
    changing a later token must leave it bit-identical, and must change blocks that do see it."""
    cfg = load_config(TINY, ["model.kv_layer_ids=[]", f"model.kind={kind}"])
    target = tiny_target("llama", **{k: v for k, v in cfg.model.target_kwargs.items() if k != "arch"})
    torch.manual_seed(0)
    drafter = build_drafter(kind, drafter_config(cfg, target), target.get_input_embeddings(),
                            target.get_output_embeddings())
    adapter = TargetAdapter(target)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    p = 15
    changed[:, p] = (ids[:, p] + 1) % 128
    anchors = torch.tensor([[3, 10, 12, 14, 15, 16, 20], [1, 11, 13, 15, 18, 22, 25]])
    outs = []
    for x in (ids, changed):
        f = adapter.full_forward(x, hidden_layer_ids=drafter.target_layer_ids, kv_layer_ids=drafter.kv_layer_ids,
                                 return_logits=True)
        with torch.no_grad():
            outs.append(drafter.forward_train(f, x, anchors))
    k = cfg.model.block_size
    sees = anchors[..., None] + torch.arange(k) >= p  # slot j of anchor a reads token a+j at most
    for name in ("logits", "confidence_logits"):
        a, b = getattr(outs[0], name), getattr(outs[1], name)
        if a is None:
            continue
        diff = (a - b).abs()
        diff = diff.amax(-1) if diff.dim() == 4 else diff
        assert (diff[~sees] == 0).all(), f"{kind} {name}: a block read target tokens after its anchor"
        # blocks anchored after p read the changed context; the test would catch a leak
        assert (diff[anchors > p] > 0).all()


@pytest.mark.slow
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path):
    """`hspec train --ranks 2` (torchrun, one thread per rank) splits the recipe's batch over the ranks: every
    step's loss and tau equal one process's with that batch."""
    over = SMALL + ["training.max_steps=2", "training.log_every=1", "training.device=cpu", "data.batch_size=4"]
    single = train(load_config(TINY, over + [f"training.output_dir={tmp_path / 'one'}"]), progress=False)
    cmd = [sys.executable, "-m", "sglang_hspec.training.trainer", "--config", str(TINY), "--no-progress", "--ranks", "2",
           *over, f"training.output_dir={tmp_path / 'two'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    for got, want in zip(log, single.history):
        assert got["loss"] == pytest.approx(want.loss, rel=1e-5)
        assert got["tau_prob"] == pytest.approx(want.tau_prob, rel=1e-5)


def test_ranks_split_the_global_batch_and_run_one_thread_each():
    from sglang_hspec.training.trainer import (
        data_parallel_command,
        rank_overrides,
        resolve_ranks,
        single_thread_env,
    )

    assert rank_overrides(batch_size=2, ranks=2) == ["data.batch_size=1"]
    assert rank_overrides(batch_size=8, ranks=4) == ["data.batch_size=2"]
    with pytest.raises(ValueError, match=r"--ranks 3 does not divide the recipe's data.batch_size=2"):
        rank_overrides(batch_size=2, ranks=3)
    cmd = data_parallel_command(config="c.yaml", overrides=["training.lr=1e-4"], ranks=2, batch_size=4, progress=False)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                       "sglang_hspec.training.trainer", "--config", "c.yaml", "--no-progress", "training.lr=1e-4",
                       "data.batch_size=2"]  # the split batch comes last, so it overrides the user's global one
    env = single_thread_env({"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HSPEC_TRAIN_THREADS": "1",
                   "ATEN_CPU_CAPABILITY": "avx2"}  # ISA caps reach the ranks
    cfg = load_config(TINY, ["training.device=cpu"])
    assert resolve_ranks("3", cfg) == 3
    assert resolve_ranks("auto", cfg) == len(os.sched_getaffinity(0))
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=f"--ranks {bad!r}: give a whole number >= 1 or auto"):
            resolve_ranks(bad, cfg)


def test_ranks_that_do_not_divide_the_batch_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    from sglang_hspec.training import trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer.subprocess, "run", lambda *a, **k: pytest.fail("torchrun started"))
    rc = trainer.main(["--config", str(TINY), "--ranks", "3", "data.batch_size=4",
                       f"training.output_dir={tmp_path}"])
    assert rc == 2
    assert "--ranks 3 does not divide the recipe's data.batch_size=4" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _tiny(cfg):
    return tiny_target("llama", **{k: v for k, v in cfg.model.target_kwargs.items() if k != "arch"})


def test_throughput_levers_leave_the_losses_unchanged_and_steps_count_tokens_and_blocks(tmp_path):
    """target_probs_once / pack_anchors against the reference path (per-slot softmax, padded anchors
    computed). num_anchors 30 > the 20 valid anchors of a 24-token sequence, so padding is there to skip."""
    over = SMALL + ["data.num_anchors=30", "training.max_steps=3"]
    runs = {}
    for once, pack in ((False, False), (True, False), (False, True), (True, True)):
        cfg = load_config(TINY, over + [f"training.target_probs_once={once}", f"training.pack_anchors={pack}",
                                        f"training.output_dir={tmp_path / f'{once}{pack}'}"])
        runs[once, pack] = train(cfg, progress=False)
    ref = [m.loss for m in runs[False, False].history]
    for key, res in runs.items():
        assert [m.loss for m in res.history] == pytest.approx(ref, rel=1e-6), key
    # 4 sequences of 24 tokens; valid anchors a: a+1 in the loss mask (positions >= 4) and a+1 < 24: 3..22
    h = runs[True, True].history
    assert [(m.tokens, m.blocks) for m in h] == [(96, 4 * 20)] * 3
    assert all(m.seconds > 0 for m in h)
    tp = runs[True, True].throughput()
    assert tp["blocks_per_s"] == pytest.approx(tp["tokens_per_s"] * 20 / 24)


def test_target_layers_init_copies_the_mapped_target_layers():
    cfg = load_config(TINY, ["model.init=target_layers"])
    target = _tiny(cfg)
    with torch.no_grad():  # non-trivial norms, so copying them is visible
        for p in target.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    examples = patterned_examples(**cfg.data.synthetic.model_dump())
    torch.manual_seed(0)
    drafter = build_model(cfg, target, examples)
    assert target_layer_map(drafter) == [2, 3, 4, 4]  # attention layers read KV of 2, 3, 4; the MF layer: the last
    for layer, src_id in zip(drafter.layers, target_layer_map(drafter)):
        src = target.model.layers[src_id]
        if layer.attn is not None:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert torch.equal(getattr(layer.attn, name).weight, getattr(src.self_attn, name).weight), name
            assert torch.equal(layer.attn_norm.weight, src.input_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp, name).weight, getattr(src.mlp, name).weight), name
        assert torch.equal(layer.mlp_norm.weight, src.post_attention_layernorm.weight)
        assert (layer.mamba.out_proj.weight == 0).all()
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    # the copies are independent parameters: training the drafter leaves the frozen target alone
    assert drafter.layers[0].attn.q_proj.weight.data_ptr() != target.model.layers[2].self_attn.q_proj.weight.data_ptr()
    torch.manual_seed(0)
    random_init = build_model(load_config(TINY, []), target, examples)
    assert not torch.equal(random_init.layers[0].attn.q_proj.weight, target.model.layers[2].self_attn.q_proj.weight)


def test_target_layers_init_with_a_narrower_mlp_is_a_clear_error():
    cfg = load_config(TINY, ["model.init=target_layers", "model.drafter.intermediate_size=96"])
    with pytest.raises(ValueError, match=r"model.init=target_layers: .*drop model.drafter.intermediate_size"):
        build_model(cfg, _tiny(cfg), patterned_examples(**cfg.data.synthetic.model_dump()))


def _tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file()}


def test_full_disk_while_saving_a_checkpoint_is_a_clear_error_and_keeps_the_previous_one(tmp_path, monkeypatch):
    cfg = load_config(TINY, SMALL + ["training.max_steps=4", "training.save_every=2", f"training.output_dir={tmp_path}"])
    real_save = torch.save
    seen = {}

    def full_disk(obj, f, *args, **kwargs):
        if Path(str(f)).name == STATE_FILE and ".checkpoint-4-" in str(f):
            seen["before"] = _tree_digest(tmp_path / "checkpoint-2")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"no space left on device writing .*checkpoint-4 .*"
                                                   r"previous checkpoint .*checkpoint-2 is intact.*resume_from=auto"):
        train(cfg, progress=False)
    assert seen["before"] and _tree_digest(tmp_path / "checkpoint-2") == seen["before"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "train_log.jsonl"]  # no temp dir left
    monkeypatch.setattr(torch, "save", real_save)
    resumed = train(load_config(TINY, SMALL + ["training.max_steps=4", "training.save_every=2",
                                               f"training.output_dir={tmp_path}", "training.resume_from=auto"]),
                    progress=False)
    assert [m.step for m in resumed.history] == [3, 4]


def _log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_gives_the_uninterrupted_losses(tmp_path):
    """`hspec train` killed (SIGKILL) twice at random moments, checkpoint writes included, then resumed with
    resume_from=auto: its per-step log equals an uninterrupted run's bit for bit (seeded data order and
    anchors, RNG state in every checkpoint)."""
    steps = 10
    over = SMALL + [f"training.max_steps={steps}", "training.save_every=1", "training.log_every=1",
                    "training.device=cpu", "training.resume_from=auto"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HSPEC_TRAIN_THREADS="1")

    def cmd(out):
        return [sys.executable, "-m", "sglang_hspec.training.trainer", "--config", str(TINY), "--no-progress",
                *over, f"training.output_dir={out}"]

    full = subprocess.run(cmd(tmp_path / "full"), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    want = _log(tmp_path / "full" / "train_log.jsonl")
    assert [r["step"] for r in want] == list(range(1, steps + 1))
    rng = random.Random(7)
    run = tmp_path / "killed"
    for kill_after in sorted(rng.sample(range(2, steps - 1), 2)):
        proc = subprocess.Popen(cmd(run), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while max((r["step"] for r in _log(run / "train_log.jsonl")), default=0) < kill_after:
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))  # anywhere in the next step: forward, backward, checkpoint write
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        proc.stderr.close()
    last = subprocess.run(cmd(run), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-3000:]
    got = _log(run / "train_log.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for g, w in zip(got, want):
        g.pop("seconds"), w.pop("seconds")
        assert g == w
    assert not list(run.glob(".checkpoint-*"))


@pytest.mark.parametrize("kind", ["hspec", "dspark"])
def test_packed_forward_train_equals_the_padded_one_on_valid_anchors(kind):
    """pack_anchors: forward_train(anchor_valid=...) computes only valid blocks; they match the padded call."""
    cfg = load_config(TINY, [f"model.kind={kind}", "model.kv_layer_ids=[]"])
    target = _tiny(cfg)
    torch.manual_seed(0)
    drafter = build_drafter(kind, drafter_config(cfg, target), target.get_input_embeddings(),
                            target.get_output_embeddings())
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    feats = TargetAdapter(target).full_forward(ids, hidden_layer_ids=drafter.target_layer_ids,
                                               kv_layer_ids=drafter.kv_layer_ids)
    anchors = torch.tensor([[2, 5, 9, 1], [3, 7, 1, 1]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    with torch.no_grad():
        full = drafter.forward_train(feats, ids, anchors)
        packed = drafter.forward_train(feats, ids, anchors, anchor_valid=valid)
    torch.testing.assert_close(packed.logits[valid], full.logits[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.confidence_logits[valid], full.confidence_logits[valid], rtol=1e-5, atol=1e-5)
    assert (packed.logits[~valid] == 0).all() and (packed.confidence_logits[~valid] == 0).all()


@pytest.mark.slow
def test_compiled_training_gives_the_eager_losses_and_weights(tmp_path, monkeypatch):
    """training.compile runs the block attention's and the loss's cores as captured graphs (dynamic shapes):
    the same per-step losses and final weights as eager, up to float rounding (fp32 pinned), and a later
    eager run in the same process is eager again. The backend is "aot_eager" here (the capture and its
    autograd graph, no C++ code generation); `scripts/bench_train.py` prints the inductor rows' losses beside
    the eager ones on the real recipe."""
    from sglang_hspec.training import trainer

    monkeypatch.setattr(trainer, "COMPILE_BACKEND", "aot_eager")
    over = SMALL + ["training.max_steps=3", "model.target_dtype=fp32", "training.bf16=false"]
    runs = {flag: train(load_config(TINY, over + [f"training.compile={flag}", f"training.output_dir={tmp_path / str(flag)}"]),
                        progress=False) for flag in (False, True)}
    eager, comp = runs[False], runs[True]
    assert [m.loss for m in comp.history] == pytest.approx([m.loss for m in eager.history], rel=1e-5)
    assert [(m.tokens, m.blocks) for m in comp.history] == [(m.tokens, m.blocks) for m in eager.history]
    from sglang_hspec.model import hspec
    from sglang_hspec.training import losses

    assert hspec._block_attention_core is not hspec.block_attention_core  # the last run's compiled cores
    assert losses._draft_terms_fn is not losses._draft_terms
    trainer.use_compiled_kernels(False, torch.device("cpu"))
    assert (hspec._block_attention_core, losses._draft_terms_fn) == (hspec.block_attention_core, losses._draft_terms)
    want = eager.drafter.state_dict()
    # lr 3e-3: a wrong gradient moves a weight by ~lr per Adam step, rounding moves it by < 1e-4
    for name, got in comp.drafter.state_dict().items():
        torch.testing.assert_close(got, want[name], rtol=0, atol=3e-4, msg=name)


def test_fused_optimizer_gives_the_per_tensor_losses_and_weights_and_resumes_their_checkpoints(tmp_path, monkeypatch):
    """training.fused_optimizer runs AdamW as torch's fused kernel: the same per-step losses and final weights
    as the per-tensor loop up to float rounding, and a checkpoint written by either resumes under the other
    (optimizer states of training runs from before the switch keep working)."""
    made = []

    class Recorded(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(bool(self.defaults.get("fused")))

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    over = SMALL + ["training.max_steps=4", "training.save_every=2", "model.target_dtype=fp32", "training.bf16=false"]
    runs = {flag: train(load_config(TINY, over + [f"training.fused_optimizer={flag}",
                                                  f"training.output_dir={tmp_path / str(flag)}"]), progress=False)
            for flag in (False, True)}
    assert made == [False, True]  # the switch reaches the optimizer
    loop, fused = runs[False], runs[True]
    assert [m.loss for m in fused.history] == pytest.approx([m.loss for m in loop.history], rel=1e-5)
    # a wrong update moves a weight by ~lr (3e-3) per Adam step; rounding moves it by far less
    want = loop.drafter.state_dict()
    for name, got in fused.drafter.state_dict().items():
        torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=name)
    crossed = train(load_config(TINY, over + ["training.fused_optimizer=true", f"training.output_dir={tmp_path / 'x'}",
                                              f"training.resume_from={tmp_path / 'False' / 'checkpoint-2'}"]),
                    progress=False)
    assert made[-1] is True and [m.step for m in crossed.history] == [3, 4]
    assert [m.loss for m in crossed.history] == pytest.approx([m.loss for m in loop.history[2:]], rel=1e-5)


def test_compile_without_a_cpp_compiler_is_a_clear_error(monkeypatch):
    from sglang_hspec.training import trainer

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(trainer.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"training\.compile=true needs a C\+\+ compiler.*training\.compile=false"):
        trainer.use_compiled_kernels(True, torch.device("cpu"))
