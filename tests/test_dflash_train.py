"""DFlash training: the context mask is strictly before the anchor and labels are same-position — a drafter trained
with either off by one must accept clearly fewer tokens (the check the DFlash spec warns about)."""

import copy
import json
from dataclasses import replace

import pytest
import torch

from sparsespec.cache import KVCache
from sparsespec.spec import train
from sparsespec.spec.decode import speculative_generate
from sparsespec.spec.dflash import DFlash, DFlashConfig, DFlashDrafter, block_labels, block_mask
from sparsespec.spec.train import TrainConfig, acceptance, fit, regenerate
from sparsespec.generate import GenerationConfig

from .conftest import CUDA, byte_engine
from .test_spec import tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    target = tiny_engine(5, vocab=48, scale=4.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (96,), generator=g)]
    taps = (0, 1)
    data = regenerate(target, prompts[:80], taps, 40, 16)
    held = regenerate(target, prompts[80:], taps, 40, 16)
    return target, data, held, taps


def test_regenerate_answers_each_prompt_in_its_place():
    """Answered in order of length, batch by batch through one runner pool: row i is prompt i and the target's own
    greedy answer to it, whichever batch answered it, with that sequence's own features."""
    target = tiny_engine(5, vocab=48, scale=4.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (11,), generator=g)]
    data = regenerate(target, prompts, (0, 1), 12, 4)
    gen = GenerationConfig(max_new_tokens=12)
    for i, p in enumerate(prompts):
        start = int(data.starts[i])
        assert data.sequence(i)[:start] == p
        assert data.sequence(i)[start:] == target.generate([p], gen).token_ids[0], i
        # its features (computed in passes of like lengths) are the sequence's own, as a pass of it alone gives them
        seq = torch.tensor(data.sequence(i))
        alone, _ = train.tapped_features(target, seq, torch.tensor([0, len(seq)]), (0, 1), 1)
        here = data.features[int(data.offsets[i]):int(data.offsets[i + 1])]
        torch.testing.assert_close(here.float(), alone.float(), rtol=1e-2, atol=1e-2)


def _train(setup, monkeypatch=None, mask=None, labels=None):
    target, data, held, taps = setup
    torch.manual_seed(0)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    cfg = TrainConfig(steps=250, batch=8, anchors=16, block_size=4, lr=3e-3, eval_every=250)
    if mask is not None:
        monkeypatch.setattr(train, "block_mask", mask)
    if labels is not None:
        monkeypatch.setattr(train, "block_labels", labels)
    seen, _ = fit(drafter, target.model, data, held, cfg, log=lambda *_: None)  # measured with the patches
    if monkeypatch is not None:
        monkeypatch.undo()
    return drafter.eval(), seen, acceptance(drafter, target.model, held)


def test_correct_offsets_train_a_drafter_that_the_loop_accepts(setup):
    target, data, held, _ = setup
    drafter, _, tau = _train(setup)
    assert tau > 1.8, tau
    # the estimate is what the real loop achieves on a held-out prompt's greedy continuation
    prompt = data.sequence(0)[:int(data.starts[0])]
    gen = GenerationConfig(max_new_tokens=40)
    out = speculative_generate(target, [prompt], DFlashDrafter(drafter, target.model), gen, 4)[0]
    assert out.token_ids == target.generate([prompt], GenerationConfig(max_new_tokens=40)).token_ids[0]
    assert out.tau > 1.5


def test_the_decoding_schedule_estimate_is_what_the_loop_commits(setup):
    """Blocks anchored as the loop anchors them (the answer's first token, then after each accepted run and the
    target's token), teacher-forced on the target's own answers: each answer's steps are the loop's steps."""
    target, _, held, _ = setup
    drafter = _train(setup)[0]
    tau, committed = train.decoding_acceptance(drafter, target.model, held, batch=3)
    total = steps = same = 0
    for i in range(len(held)):
        prompt, answer = held.sequence(i)[:int(held.starts[i])], held.sequence(i)[int(held.starts[i]):]
        gen = GenerationConfig(max_new_tokens=len(answer), stop_on_eos=False)
        out = speculative_generate(target, [prompt], DFlashDrafter(drafter, target.model), gen, 4)[0]
        assert out.token_ids == answer  # the loop follows the answer the estimate is forced on
        assert sum(committed[i]) == len(answer) - 1  # every answer token after the first, once
        same += out.committed == committed[i]
        total, steps = total + sum(out.committed), steps + out.steps
    assert same >= len(held) - 1, same  # (a drafter's near-tie may round apart in its two code paths)
    assert tau == pytest.approx(total / steps, rel=0.02)
    assert 1.5 < tau <= 4


def test_a_context_mask_that_includes_the_anchor_trains_a_useless_drafter(setup, monkeypatch):
    _, _, good = _train(setup)
    leak = lambda anchors, lengths, T, B, window: block_mask(anchors + 1, lengths, T, B, window)  # noqa: E731
    _, seen, bad = _train(setup, monkeypatch, mask=leak)
    assert min(seen, good) > bad + 0.3, (seen, good, bad)  # looks as good while training, accepts less deployed


def test_labels_shifted_by_one_train_a_useless_drafter(setup, monkeypatch):
    _, _, good = _train(setup)

    def shifted(tokens, anchors, lengths, B, greedy):
        return block_labels(tokens, anchors + 1, lengths, B, greedy)

    _, _, bad = _train(setup, monkeypatch, labels=shifted)
    assert bad < good - 1.0, (good, bad)


def test_fit_resumes_and_always_ends_with_an_evaluation(setup, tmp_path):
    target, data, held, taps = setup
    cfg = TrainConfig(steps=12, batch=2, anchors=4, block_size=4, eval_every=5)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    tau, history = fit(drafter, target.model, data, held, cfg, tmp_path / "ckpt.pt", log=lambda *_: None)
    assert [h["step"] for h in history] == [5, 10, 12] and tau == history[-1]["heldout_tau"]
    again = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    tau2, history2 = fit(again, target.model, data, held, cfg, tmp_path / "ckpt.pt", log=lambda *_: None)
    # nothing left to do: the same weights, and the run's results as they were (no re-evaluation row of loss NaN)
    assert history2 == history and tau2 == tau
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values()))


def test_a_run_from_an_earlier_drafter_first_evaluates_it_on_its_held_out_prompts(setup, tmp_path):
    target, data, held, taps = setup
    cfg = TrainConfig(steps=3, batch=2, anchors=4, block_size=4, eval_every=5)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    before = acceptance(copy.deepcopy(drafter).eval(), target.model, held)
    tau, history = fit(drafter, target.model, data, held, cfg, tmp_path / "ckpt.pt", log=lambda *_: None,
                       evaluate_first=True)
    assert [h["step"] for h in history] == [0, 3] and tau == history[-1]["heldout_tau"]
    assert history[0]["heldout_tau"] == pytest.approx(before)


def test_a_run_folder_refuses_other_settings(tmp_path):
    from sparsespec.errors import SparseSpecError

    train.check_settings(tmp_path / "settings.json", {"data": {"prompts": 4}, "drafter": {"layers": 1}})
    train.check_settings(tmp_path / "settings.json", {"data": {"prompts": 4}, "drafter": {"layers": 1}})
    with pytest.raises(SparseSpecError, match="other drafter settings"):
        train.check_settings(tmp_path / "settings.json", {"data": {"prompts": 4}, "drafter": {"layers": 2}})


def test_a_run_can_start_from_an_earlier_drafter_of_the_same_shape(setup, tmp_path):
    """`--init`: training continued in a later session from the drafter an earlier one brought back (the optimiser
    state is too large to bring back): the weights are copied exactly, the provenance kept, another shape refused."""
    from sparsespec.errors import SparseSpecError

    target, data, held, taps = setup
    cfg = TrainConfig(steps=30, batch=4, anchors=8, block_size=4, lr=3e-3, eval_every=30)
    first = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    tau, _ = fit(first, target.model, data, held, cfg, log=lambda *_: None)
    first.save(tmp_path / "d", dtype=torch.float32, meta={"heldout_tau": tau, "train": {"steps": 30}})
    again = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    came = train.start_from(again, tmp_path / "d.safetensors")
    assert came == {"path": str(tmp_path / "d.safetensors"), "heldout_tau": tau, "train": {"steps": 30}}
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert acceptance(again.eval(), target.model, held) == pytest.approx(acceptance(first.eval(), target.model, held))
    longer = DFlash(DFlashConfig(target.config, layers=1, block_size=5, taps=taps))
    with pytest.raises(SparseSpecError, match="another drafter shape \\(block_size differ\\)"):
        train.start_from(longer, tmp_path / "d")
    deeper = DFlash(DFlashConfig(target.config, layers=2, block_size=4, taps=taps))
    deeper.save(tmp_path / "deep", dtype=torch.float32, meta={"heldout_tau": tau})
    with pytest.raises(SparseSpecError, match="another drafter shape \\(layers differ\\)"):
        train.start_from(again, tmp_path / "deep")  # fewer layers than the file: refused
    windowed = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps, window=6))
    train.start_from(windowed, tmp_path / "d")  # a context window changes no weight's shape: allowed
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), windowed.state_dict().values()))
    assert DFlash.load(tmp_path / "d").cfg.window == 0
    windowed.save(tmp_path / "w", dtype=torch.float32, meta={})
    assert DFlash.load(tmp_path / "w").cfg.window == 6  # (kept in the file's config)


def test_a_deeper_drafter_grows_from_a_shallower_one_and_drafts_alike_until_trained(setup, tmp_path):
    """`--init` with more --layers than the file: its layers come first, each added one starts as the identity (zero
    output projections), so the grown drafter's block hidden states — and its loss — equal the file's; a training
    step then moves the added layers."""
    target, data, held, taps = setup
    cfg = TrainConfig(steps=20, batch=4, anchors=8, block_size=4, lr=3e-3, eval_every=20)
    torch.manual_seed(3)
    first = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    fit(first, target.model, data, held, cfg, log=lambda *_: None)
    first.save(tmp_path / "d", dtype=torch.float32, meta={"heldout_tau": 1.5})
    torch.manual_seed(4)
    grown = DFlash(DFlashConfig(target.config, layers=3, block_size=4, taps=taps))
    came = train.start_from(grown, tmp_path / "d")
    assert came["grown_from_layers"] == 1 and came["heldout_tau"] == 1.5
    assert torch.equal(grown.layers[0].self_attn.qkv_proj.weight, first.layers[0].self_attn.qkv_proj.weight)
    assert grown.layers[2].self_attn.qkv_proj.weight.abs().sum() > 0  # the added layers keep their own init ...
    assert grown.layers[2].mlp.down_proj.weight.abs().sum() == 0  # ... but add nothing yet
    rows = torch.tensor([0, 3, 8])
    anchors = train.sample_anchors(data, rows, 5, torch.Generator().manual_seed(2))
    before, _, _ = train.block_loss(first.eval(), target.model, data, rows, anchors)
    after, _, _ = train.block_loss(grown.eval(), target.model, data, rows, anchors)
    assert torch.allclose(before, after, rtol=1e-6, atol=1e-6), (before, after)
    fit(grown.train(), target.model, data, held, TrainConfig(steps=2, batch=4, anchors=8, block_size=4, lr=3e-3,
                                                              eval_every=2), log=lambda *_: None)
    assert grown.layers[2].mlp.down_proj.weight.abs().sum() > 0


@pytest.mark.parametrize("warmup", ["1", "-0.1", "abc"])
def test_train_refuses_a_warmup_outside_its_range_in_one_line(tmp_path, capsys, warmup):
    from sparsespec.cli import main

    assert main(["train", "dflash", "--out", str(tmp_path / "run"), "--warmup", warmup]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("warmup" in err[0]), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["dflash", "--target"], ["finetune", "--domain", "kjv", "--model"]])
def test_train_whose_model_does_not_load_leaves_no_folder_and_an_unwritable_one_is_refused(tmp_path, capsys, argv):
    from sparsespec.cli import main

    assert main(["train", *argv, "no-such-model", "--out", str(tmp_path / "a" / "run")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-model" in err[0], err
    assert not (tmp_path / "a").exists()  # the run's folder is made as the run writes into it
    (tmp_path / "file").write_text("")
    assert main(["train", *argv, "no-such-model", "--out", str(tmp_path / "file" / "run")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write to" in err[0] and "is not a folder" in err[0], err


def test_an_output_folder_is_checked_made_or_not_and_refused_under_a_file(tmp_path):
    from sparsespec.cli import _writable_folder
    from sparsespec.errors import SparseSpecError

    assert _writable_folder(str(tmp_path / "a" / "b"), create=False) == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    _writable_folder(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())  # made, left empty
    (tmp_path / "file").write_text("x")
    for create in (True, False):
        with pytest.raises(SparseSpecError, match=f"cannot write to .*: {tmp_path / 'file'} is not a folder"):
            _writable_folder(str(tmp_path / "file" / "c"), create=create)
    assert (tmp_path / "file").read_text() == "x"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # a link to nothing: no folder can be made there
    for path in ("dangling", "dangling/d"):
        for create in (True, False):
            with pytest.raises(SparseSpecError, match=f"{tmp_path / 'dangling'} is not a folder"):
                _writable_folder(str(tmp_path / path), create=create)


@pytest.mark.parametrize("bad,needle", [(dict(max_new_tokens=1), "max-new-tokens must be >= 2"),
                                        (dict(time_limit=float("nan")), "time limit must be >= 0 seconds, got nan"),
                                        (dict(time_limit=-1.0), "time limit must be >= 0 seconds, got -1"),
                                        (dict(window=-1), "window must be >= 0 context tokens")])
def test_train_config_refuses_answers_too_short_for_a_block_and_a_bad_time_limit(bad, needle):
    from sparsespec.errors import SparseSpecError

    with pytest.raises(SparseSpecError, match=needle):
        TrainConfig(**bad)


def test_train_refuses_more_taps_than_the_target_has_layers(tmp_path):
    from sparsespec.errors import SparseSpecError

    engine = byte_engine(0)  # 2 layers
    cfg = TrainConfig(prompts=4, heldout=2, max_new_tokens=8, gen_batch=4, steps=2, batch=2, anchors=4, block_size=4,
                      taps=3)
    with pytest.raises(SparseSpecError, match="taps must be <= the target's 2 layers"):
        train.train_dflash(engine, cfg, tmp_path / "run", "byte", log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_missing_init_drafter_before_any_work(tmp_path, capsys):
    from sparsespec.cli import main

    assert main(["train", "dflash", "--out", str(tmp_path / "run"), "--init", str(tmp_path / "none")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--init" in err[0] and "no drafter there" in err[0]


def test_a_drafter_stored_in_fp8_loads_within_fp8s_precision_at_half_the_bytes(setup, tmp_path):
    """`save(dtype=float8_e4m3fn)` (`train dflash --storage fp8`): the matrices in FP8 with a scale per row, the
    vectors in bf16; `load` restores real values; the file is about half the bf16 one."""
    target, data, held, taps = setup
    torch.manual_seed(1)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps, intermediate_size=64))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
    drafter.save(tmp_path / "bf16")
    drafter.save(tmp_path / "fp8", dtype=torch.float8_e4m3fn, meta={"heldout_tau": 2.0})
    sizes = {n: (tmp_path / f"{n}.safetensors").stat().st_size for n in ("bf16", "fp8")}
    assert sizes["fp8"] < 0.6 * sizes["bf16"], sizes
    back = DFlash.load(tmp_path / "fp8")
    info = __import__("json").loads((tmp_path / "fp8.json").read_text())
    assert info["storage"] == "fp8" and info["heldout_tau"] == 2.0
    for (name, a), b in zip(drafter.state_dict().items(), back.state_dict().values()):
        a = a.to(torch.bfloat16).float()  # what bf16 storage keeps
        if a.dim() == 2:  # within FP8's 3 mantissa bits of each row's scale
            assert ((b - a).abs() <= 2**-4 * a.abs() + 2**-9 * a.abs().amax(1, keepdim=True)).all(), name
            assert not torch.equal(a, b)
        else:
            assert torch.equal(a, b), name


def test_packed_data_holds_each_sequences_own_features_and_reloads_them_from_its_tokens(setup, tmp_path):
    """Sequences are stored end to end without padding; their features equal a forward pass over each sequence alone
    (batches padded to their own longest row change nothing); a saved set keeps only tokens and rebuilds the rest."""
    target, data, _, taps = setup
    assert data.offsets[0] == 0 and int(data.offsets[-1]) == data.tokens.shape[0] == data.features.shape[0]
    from sparsespec.cache import KVCache

    for i in (0, 7, len(data) - 1):
        seq = torch.tensor([data.sequence(i)])
        cache = KVCache(target.config, 1, seq.shape[1], target.dtype, target.device)
        _, alone = target.model.forward_tapped(seq, torch.arange(seq.shape[1])[None], cache, seq.shape[1], taps)
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        torch.testing.assert_close(data.features[lo:hi].float(), alone[0].to(torch.bfloat16).float())
    rows = torch.tensor([3, 0, 5])
    tokens, feats, lengths, cut, _ = data.batch(rows)
    assert not cut.any()  # (no window: every token has features)
    for j, r in enumerate(rows.tolist()):
        n = int(lengths[j])
        assert tokens[j, :n].tolist() == data.sequence(r)
        assert torch.equal(feats[j, :n], data.features[int(data.offsets[r]):int(data.offsets[r + 1])])
    data.save(tmp_path / "d.safetensors")
    again = train.Dataset.load(tmp_path / "d.safetensors", target, taps, batch=5)  # other batches, other padding
    assert torch.equal(again.tokens, data.tokens) and torch.equal(again.starts, data.starts)
    torch.testing.assert_close(again.features.float(), data.features.float(), atol=1e-2, rtol=1e-2)


def test_a_windowed_data_set_keeps_only_what_the_window_sees_and_trains_alike(setup, tmp_path):
    """A drafter of context window W sees an answer and the W prompt tokens before it: a data set made for it keeps
    only those tokens' features (each equal to the whole sequence's), the same blocks give the loss (and logits)
    that the whole data set gives that drafter, save/load and subset keep the window, and a drafter it cannot serve
    (no window, a wider one) is refused."""
    from sparsespec.errors import SparseSpecError

    target, data, _, taps = setup
    W = 3
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(2, 14, (9,), generator=g)]
    whole = regenerate(target, prompts, taps, 9, 4)
    cut = regenerate(target, prompts, taps, 9, 4, window=W)
    assert torch.equal(cut.tokens, whole.tokens) and torch.equal(cut.starts, whole.starts)
    drop = (whole.starts - W).clamp(min=0)
    assert torch.equal(cut.cut, drop) and drop.any() and (drop == 0).any()  # long prompts cut, short ones not
    assert cut.features.shape[0] == whole.features.shape[0] - int(drop.sum())
    for i in range(len(whole)):
        lo, hi = int(whole.offsets[i]), int(whole.offsets[i + 1])
        fo = cut.feature_offsets
        torch.testing.assert_close(cut.features[int(fo[i]):int(fo[i + 1])].float(),
                                   whole.features[lo + int(drop[i]):hi].float(), atol=1e-2, rtol=1e-2)
    torch.manual_seed(0)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps, window=W)).eval()
    rows = torch.tensor([4, 0, 7, 2])
    anchors = train.sample_anchors(whole, rows, 5, torch.Generator().manual_seed(1))
    tokens, _, lengths, at, _ = cut.batch(rows)
    for j, r in enumerate(rows.tolist()):
        assert tokens[j, :int(lengths[j])].tolist() == whole.sequence(r)[int(drop[r]):]
    with torch.no_grad():
        loss_w, logits_w, labels_w = train.block_loss(drafter, target.model, whole, rows, anchors)
        loss_c, logits_c, labels_c = train.block_loss(drafter, target.model, cut, rows, anchors)
    assert torch.equal(labels_c, labels_w)
    torch.testing.assert_close(logits_c, logits_w, atol=2e-3, rtol=2e-3)  # (rotary at other absolute positions)
    torch.testing.assert_close(loss_c, loss_w, atol=1e-4, rtol=1e-4)
    committed = [train.decoding_acceptance(drafter, target.model, d)[1] for d in (cut, whole)]
    margin = float("inf")  # the smallest top-2 logit gap over the blocks the schedule visits (on the whole set)
    for r, steps in enumerate(committed[1]):
        at = (int(whole.starts[r]) + torch.tensor([0, *steps[:-1]]).cumsum(0))[None]  # [1, steps]
        with torch.no_grad():
            top2 = train.block_loss(drafter, target.model, whole, torch.tensor([r]), at)[1].topk(2, -1).values
        margin = min(margin, float((top2[..., 0] - top2[..., 1]).min()))
    if margin > 1e-3:  # (no near-tie that other rounding could break the other way)
        assert committed[0] == committed[1]
    cut.save(tmp_path / "c.safetensors")
    again = train.Dataset.load(tmp_path / "c.safetensors", target, taps, batch=3, window=W)
    assert torch.equal(again.tokens, whole.tokens) and again.window == W  # (the file holds whole sequences)
    torch.testing.assert_close(again.features.float(), cut.features.float(), atol=1e-2, rtol=1e-2)
    part = cut.subset(torch.tensor([5, 1]))
    assert part.window == W and torch.equal(part.features, torch.cat(
        [cut.features[int(cut.feature_offsets[r]):int(cut.feature_offsets[r + 1])] for r in (5, 1)]))
    for other in (0, W + 1):
        wrong = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps, window=other))
        with pytest.raises(SparseSpecError, match="context window of 3 tokens"):
            train.block_loss(wrong, target.model, cut, rows, anchors)
    with pytest.raises(SparseSpecError, match="context windows 3 and 0"):
        cut.concat(whole)


def test_earlier_answers_add_to_new_ones_once_and_only_the_same_targets(setup, tmp_path):
    """`--add-data`: an earlier run's data set (its tokens, int32 on disk) joins the answers regenerated now,
    a prompt answered in both kept once; another model's data set is refused."""
    from sparsespec.errors import SparseSpecError

    target, data, held, taps = setup
    first = data.subset(torch.arange(0, 50))
    first.save(tmp_path / "old.safetensors", train.fingerprint(target))
    later = data.subset(torch.arange(30, 80))
    both = later.concat(train.Dataset.load(tmp_path / "old.safetensors", target, taps, batch=8))
    assert len(both) == 80 and [both.sequence(i) for i in range(50)] == [later.sequence(i) for i in range(50)]
    assert sorted(tuple(both.sequence(i)) for i in range(80)) == sorted(tuple(data.sequence(i)) for i in range(80))
    lo = int(both.offsets[50])
    torch.testing.assert_close(both.features[lo:].float(), first.features[:int(first.offsets[30])].float(),
                               atol=1e-2, rtol=1e-2)
    again = first.concat(first)  # (every prompt held already: nothing joins)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.features, first.features)
    with pytest.raises(SparseSpecError, match="another model's answers"):
        train.Dataset.load(tmp_path / "old.safetensors", tiny_engine(6, vocab=48, scale=4.0), taps, batch=8)
    # end to end: a run with an earlier run's data trains on both (and records them)
    prompts_cfg = TrainConfig(prompts=4, heldout=2, max_new_tokens=8, gen_batch=4, steps=2, batch=2, anchors=4,
                              block_size=4, eval_every=2, taps=2)
    engine = byte_engine(0)
    summary = train.train_dflash(engine, prompts_cfg, tmp_path / "a", "byte", log=lambda *_: None)
    run = train.train_dflash(engine, replace(prompts_cfg, seed=1), tmp_path / "b", "byte", log=lambda *_: None,
                             add_data=(tmp_path / "a" / "data.safetensors",))
    seen = train.Dataset.load(tmp_path / "b" / "data.safetensors", engine, (0, 1), 4)
    assert 4 < len(seen) <= 8 and "--add-data" in run["made_by"] and summary["made_by"]
    assert 1 <= summary["heldout_tau_decoding"] <= prompts_cfg.block_size
    drafter = DFlash.load(tmp_path / "a" / "drafter")
    assert summary["trainable_parameters"] == summary["parameters"] == sum(p.numel() for p in drafter.parameters())


def test_spans_of_the_prompts_are_labelled_by_the_targets_own_choices(setup, tmp_path):
    """`--spans N`: each training prompt's last N tokens join the data, labelled by the target's argmax after each
    token (from the features' pass: each equal to a pass over the sequence alone), a run's spans and answers from one
    pass as they are from two; on the target's own answers those choices are the answers' tokens; the labelling
    survives save/load and a resume, and a set labelled by tokens does not join one labelled by choices (but one
    that adds a spans run's data is labelled by choices)."""
    from sparsespec.errors import SparseSpecError

    target, data, _, taps = setup
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(6, 16, (7,), generator=g)]
    prompts.append([7, 30, 2])  # (shorter than a span: all but its first token)
    answered = regenerate(target, prompts, taps, 9, 4, greedy=True)
    spans = train.packed(target, prompts, [max(1, len(p) - 5) for p in prompts], taps, 3, window=2, greedy=True)
    # a run's set: the answers, then the spans, both from the answers' pass (as from a pass of their own)
    for window, own in ((2, spans), (0, train.packed(target, prompts, [max(1, len(p) - 5) for p in prompts], taps, 3,
                                                     greedy=True))):
        both = regenerate(target, prompts, taps, 9, 4, window=window, spans=5)
        alone = regenerate(target, prompts, taps, 9, 4, window=window, greedy=True).concat(own)
        assert len(both) == 2 * len(prompts) and torch.equal(both.tokens, alone.tokens)
        assert torch.equal(both.starts, alone.starts) and torch.equal(both.offsets, alone.offsets)
        torch.testing.assert_close(both.features.float(), alone.features.float(), atol=1e-2, rtol=1e-2)
        assert both.greedy.shape == alone.greedy.shape == both.features.shape[:1]
    rows = torch.arange(len(spans))
    with pytest.raises(ValueError):  # (answers a token earlier need features the window did not keep)
        spans.view(rows, spans.starts - 1, spans.lengths)
    for d in (answered, spans, both):
        fo = d.feature_offsets
        for i in range(len(d)):
            seq = torch.tensor([d.sequence(i)])
            logits = target.model.logits(target.model(seq, torch.arange(seq.shape[1])[None],
                                                      KVCache(target.config, 1, seq.shape[1], target.dtype,
                                                              target.device), seq.shape[1]))[0]  # [T, V]
            top2 = logits.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1] > 1e-3)[int(d.cut[i]):]  # (near-ties may fall either way)
            mine = d.greedy[int(fo[i]):int(fo[i + 1])]
            assert torch.equal(mine[clear], logits.argmax(-1)[int(d.cut[i]):][clear]), i
    # on its own answers the target's choices are the answer's tokens (labels alike but for near-ties)
    rows = torch.arange(len(answered))
    tokens, _, lengths, _, greedy = answered.batch(rows)
    starts = answered.starts
    for j in range(len(answered)):
        own = greedy[j, int(starts[j]) - 1:int(lengths[j]) - 1] == tokens[j, int(starts[j]):int(lengths[j])]
        assert own.float().mean() > 0.9, j
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps, window=2)).eval()
    rows = torch.arange(len(spans))
    anchors = train.sample_anchors(spans, rows, 3, torch.Generator().manual_seed(2))
    with torch.no_grad():
        labels = train.block_loss(drafter, target.model, spans, rows, anchors)[2]
    tokens, _, lengths, cut, greedy = spans.batch(rows)
    assert torch.equal(labels, block_labels(tokens, anchors - cut[:, None], lengths, 4, greedy)[..., 1:])
    assert (labels >= 0).any() and not torch.equal(labels, block_labels(tokens, anchors - cut[:, None], lengths,
                                                                         4)[..., 1:])  # (the text is not its own)
    answered.save(tmp_path / "g.safetensors", train.fingerprint(target))
    again = train.Dataset.load(tmp_path / "g.safetensors", target, taps, batch=2)
    assert again.greedy is not None and torch.equal(again.greedy, answered.greedy)
    with pytest.raises(SparseSpecError, match="labelled by"):
        data.concat(again)
    whole = train.packed(target, prompts, [max(1, len(p) - 5) for p in prompts], taps, 3, greedy=True)  # (no window)
    assert torch.equal(again.concat(whole).greedy, torch.cat([again.greedy, whole.greedy]))
    # end to end: a run with spans trains on answers and spans, records them, and resumes on the same labels
    cfg = TrainConfig(prompts=4, heldout=2, max_new_tokens=8, gen_batch=4, steps=2, batch=2, anchors=4,
                      block_size=4, eval_every=2, taps=2, spans=6)
    engine = byte_engine(0)
    summary = train.train_dflash(engine, cfg, tmp_path / "s", "byte", log=lambda *_: None)
    seen = train.Dataset.load(tmp_path / "s" / "data.safetensors", engine, (0, 1), 4)
    assert len(seen) == 8 and seen.greedy is not None and int((seen.lengths - seen.starts)[4:].max()) == 6
    assert "--spans 6" in summary["made_by"]
    assert json.loads((tmp_path / "s" / "settings.json").read_text())["data"]["spans"] == 6
    saved = (tmp_path / "s" / "data.safetensors").stat().st_mtime_ns
    more = train.train_dflash(engine, replace(cfg, steps=4), tmp_path / "s", "byte", log=lambda *_: None)  # resumes
    assert more["history"][-1]["step"] == 4 and (tmp_path / "s" / "data.safetensors").stat().st_mtime_ns == saved
    # an earlier spans run's data joins a run without spans: the new answers are then labelled by choices too
    joined = train.train_dflash(engine, replace(cfg, spans=0, seed=1), tmp_path / "t", "byte", log=lambda *_: None,
                                add_data=(tmp_path / "s" / "data.safetensors",))
    assert train.Dataset.load(tmp_path / "t" / "data.safetensors", engine, (0, 1), 4).greedy is not None
    assert joined["heldout_tau"] >= 1
    with pytest.raises(SparseSpecError):
        TrainConfig(spans=1)


def test_the_schedule_warms_up_then_decays_to_zero_over_the_progress():
    cfg = TrainConfig(lr=1e-3, warmup=0.1)
    assert train.learning_rate(cfg, 0.0) == 0.0
    assert train.learning_rate(cfg, 0.05) == pytest.approx(5e-4)
    assert train.learning_rate(cfg, 0.1) == pytest.approx(1e-3)
    assert train.learning_rate(cfg, 0.55) == pytest.approx(5e-4)
    assert train.learning_rate(cfg, 1.0) == pytest.approx(0.0, abs=1e-12)


def test_a_time_limit_ends_training_on_its_clock_and_a_resume_continues_that_clock(setup, tmp_path):
    """Steps are many, the time limit short: training stops when the optimisation time reaches the limit (evaluations
    not counted), whatever a step costs; the checkpoint keeps the seconds, so a resume with the same limit has
    nothing left to do."""
    target, data, held, taps = setup
    cfg = TrainConfig(steps=10**9, batch=2, anchors=4, block_size=4, eval_every=10**6, time_limit=0.5)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    _, history = fit(drafter, target.model, data, held, cfg, tmp_path / "ckpt.pt", log=lambda *_: None)
    state = torch.load(tmp_path / "ckpt.pt")
    assert 0 < state["step"] == history[-1]["step"] < 10**9 and state["seconds"] >= 0.5
    again = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    _, history2 = fit(again, target.model, data, held, cfg, tmp_path / "ckpt.pt", log=lambda *_: None)
    assert [h["step"] for h in history2] == [state["step"]]


def test_a_non_finite_step_is_skipped_and_training_goes_on(setup, monkeypatch):
    target, data, held, taps = setup
    calls, lines = [], []

    def poisoned(*args):
        loss, logits, labels = block_loss(*args)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), logits, labels

    block_loss = train.block_loss
    monkeypatch.setattr(train, "block_loss", poisoned)
    torch.manual_seed(0)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    fit(drafter, target.model, data, held, TrainConfig(steps=6, batch=2, anchors=4, block_size=4, eval_every=100),
        log=lines.append)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    assert any("step 3: non-finite gradient, skipped (1 so far)" in line for line in lines), lines


def _parallel_worker(out: str) -> None:
    """One of two gloo processes: its share of the prompts, its own start (made equal by the broadcast), fit; then
    the second process fails while the first waits for it."""
    from sparsespec.errors import SparseSpecError
    from sparsespec.spec.ranks import Ranks

    torch.set_num_threads(1)  # two processes on a 2-core runner
    ranks = Ranks.current()
    target = tiny_engine(5, vocab=48, scale=4.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (96,), generator=g)]
    data = regenerate(target, ranks.share(prompts[:80]), (0, 1), 40, 16)
    held = regenerate(target, ranks.share(prompts[80:]), (0, 1), 40, 16)
    torch.manual_seed(ranks.rank)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=(0, 1)))
    ranks.broadcast_(drafter.parameters())
    cfg = TrainConfig(steps=150, batch=4, anchors=16, block_size=4, lr=3e-3, eval_every=150)
    tau, _ = fit(drafter, target.model, data, held, cfg, log=lambda *_: None, ranks=ranks)
    torch.save({"state": drafter.state_dict(), "tau": tau, "first": data.sequence(0)}, f"{out}/rank{ranks.rank}.pt")
    ranks.barrier()
    if ranks.rank == 1:
        raise SparseSpecError("the data folder is full")
    ranks.barrier()  # never passed: rank 1 is gone, and this process is ended with it (not left hanging)


def test_data_parallel_training_keeps_the_processes_drafters_equal_on_their_own_shares(setup, tmp_path):
    """Two processes (gloo on CPU): each answers every second prompt and draws its own rows; averaged gradients keep
    their drafters bitwise equal from the broadcast start on; the held-out tau is the one of both shares; it trains.
    A process that fails ends them all, and its own message is the one reported (not the others' lost peer)."""
    from sparsespec.errors import SparseSpecError
    from sparsespec.spec.ranks import spawn

    _, data, _, _ = setup
    with pytest.raises(SparseSpecError) as e:
        spawn(_parallel_worker, 2, "cpu", str(tmp_path))
    assert str(e.value) == "the data folder is full"
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a["state"].values(), b["state"].values()))
    assert a["tau"] == b["tau"] > 1.5, (a["tau"], b["tau"])
    assert a["first"] == data.sequence(0) and b["first"] == data.sequence(1)  # prompts 0 and 1: one each


def test_answers_are_generated_in_device_sized_batches_unless_told():
    from sparsespec.cli import _gen_batch, build_parser

    parser = build_parser()
    for what in (["dflash"], ["eda", "--target", "t", "--base-drafter", "b", "--domain", "kjv"]):
        for extra, want in (([], 32), (["--device", "cuda"], 128), (["--gen-batch", "7", "--device", "cuda"], 7)):
            args = parser.parse_args(["train", *what, "--out", "o", *extra])
            assert _gen_batch(args) == want, (what, extra)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_cuda_loss_equals_the_cpu_loss(setup):
    """On CUDA the loss pads the batch to a multiple of 64 tokens and reads the logits through the Triton
    cross-entropy: the loss and the drafter's gradients equal the CPU's (fp32 throughout)."""
    target, data, _, taps = setup
    torch.manual_seed(0)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    rows = torch.tensor([0, 5, 9, 30])
    anchors = train.sample_anchors(data, rows, 6, torch.Generator().manual_seed(1))
    results = []
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(drafter).to(device)
        on = train.Dataset(*(getattr(data, k).to(device) for k in ("tokens", "offsets", "starts", "features")))
        loss, _, labels = train.block_loss(model, copy.deepcopy(target.model).to(device), on, rows.to(device),
                                           anchors.to(device))
        loss.backward()
        results.append((loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()], labels.cpu()))
    (cpu_loss, cpu_grads, cpu_labels), (gpu_loss, gpu_grads, gpu_labels) = results
    assert torch.equal(cpu_labels, gpu_labels)
    assert torch.allclose(cpu_loss, gpu_loss, rtol=1e-4, atol=1e-5), (cpu_loss, gpu_loss)
    for a, b in zip(cpu_grads, gpu_grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), (a - b).abs().max()


@pytest.mark.skipif(CUDA, reason="runs the kernel on CPU tensors (Triton's interpreter, set only without CUDA); "
                    "test_the_cuda_loss_equals_the_cpu_loss checks it on the GPU")
def test_the_loss_through_the_triton_cross_entropy_equals_the_torch_loss(setup, monkeypatch):
    """The CUDA path of `block_ce` (the Triton kernel, here in its CPU interpreter) gives the CPU path's loss and
    gradients."""
    pytest.importorskip("triton")
    target, data, _, taps = setup
    torch.manual_seed(0)
    drafter = DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=taps))
    rows = torch.tensor([1, 7, 40])
    anchors = train.sample_anchors(data, rows, 5, torch.Generator().manual_seed(2))
    results = []
    for kernel in (False, True):
        monkeypatch.setattr(train, "triton_ready", lambda device, kernel=kernel: kernel)
        model = copy.deepcopy(drafter)
        loss = train.block_loss(model, target.model, data, rows, anchors)[0]
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (ref, ref_grads), (got, got_grads) = results
    assert torch.allclose(ref, got, rtol=1e-5), (ref, got)
    for a, b in zip(ref_grads, got_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()


@pytest.mark.parametrize("setting", [{"lr": float("inf")}, {"lr": float("nan")}, {"clip": float("inf")},
                                     {"weight_decay": float("inf")}, {"lr": 0.0}, {"warmup": 1.0}])
def test_training_refuses_rates_that_train_nothing_but_nans(setting):
    """(each refusal names the setting at fault)"""
    from sparsespec.errors import SparseSpecError
    from sparsespec.spec.finetune import FinetuneConfig
    from sparsespec.spec.train import TrainConfig

    (key, value), = setting.items()
    named = f"^{key.replace('_', ' ')} must be .*, got {value}$"
    with pytest.raises(SparseSpecError, match=named):
        TrainConfig(**setting)
    with pytest.raises(SparseSpecError, match=named):
        FinetuneConfig(domain="kjv", **setting)
    with pytest.raises(SparseSpecError, match="^alpha must be a finite number > 0, got inf$"):
        FinetuneConfig(domain="kjv", alpha=float("inf"))
