"""EDA: LoRA fine-tunes of a target (adapters that merge exactly), the decoupled drafter (drafts as its base until
trained; only its private part trains), sample selection that finds the samples a base drafter gets wrong, and
`train eda` / `train finetune` end to end."""

import json

import pytest
import torch

from sparsespec.errors import SparseSpecError
from sparsespec.generate import GenerationConfig
from sparsespec.spec.decode import speculative_generate
from sparsespec.spec.dflash import DFlash, DFlashConfig, DFlashDrafter
from sparsespec.spec.eda import (EdaConfig, adapt_parameters, decouple, sample_scores, select, target_nll,
                                 train_eda)
from sparsespec.spec.finetune import FinetuneConfig, add_lora, apply_adapter, finetune, merge_lora
from sparsespec.spec.train import Dataset, TrainConfig, acceptance, fit, regenerate

from .conftest import byte_engine
from .test_spec import tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def _forward(model, tokens):
    from sparsespec.cache import KVCache

    cache = KVCache(model.cfg, tokens.shape[0], tokens.shape[1], torch.float32, tokens.device)
    return model.forward(tokens, torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1), cache, tokens.shape[1])


def test_lora_starts_as_the_base_and_merges_into_the_weights_exactly(tmp_path):
    from safetensors.torch import save_file

    from sparsespec.spec.finetune import adapter_state

    engine = tiny_engine(3)
    tokens = torch.randint(0, 64, (2, 9))
    base = _forward(engine.model, tokens)
    loras = add_lora(engine.model, rank=4, alpha=8.0)
    assert len(loras) == 4 * engine.config.num_layers
    torch.testing.assert_close(_forward(engine.model, tokens), base, rtol=0, atol=0)  # B = 0: unchanged
    with torch.no_grad():
        for m in loras.values():
            m.lora_b.normal_(0, 0.05)
    adapted = _forward(engine.model, tokens)
    assert (adapted - base).abs().max() > 1e-2
    state = adapter_state(loras)
    merge_lora(engine.model)
    assert not any("lora" in n for n, _ in engine.model.named_parameters())
    torch.testing.assert_close(_forward(engine.model, tokens), adapted, rtol=1e-4, atol=1e-4)
    # the adapter file applied to a fresh copy of the base gives the same model
    (tmp_path / "ad").mkdir()
    save_file(state, str(tmp_path / "ad" / "adapter.safetensors"))
    (tmp_path / "ad" / "adapter.json").write_text(json.dumps({"base": "tiny", "rank": 4, "alpha": 8.0}))
    fresh = tiny_engine(3)
    apply_adapter(fresh.model, tmp_path / "ad")
    torch.testing.assert_close(_forward(fresh.model, tokens), adapted, rtol=1e-4, atol=1e-4)
    with pytest.raises(SparseSpecError, match="does not fit this model"):
        apply_adapter(tiny_engine(3, layers=3).model, tmp_path / "ad")
    (tmp_path / "ad" / "adapter.json").write_text("{not json")
    with pytest.raises(SparseSpecError, match="corrupt adapter"):
        apply_adapter(fresh.model, tmp_path / "ad")


def test_finetune_lowers_the_domain_loss_resumes_and_loads_as_a_model(tmp_path):
    engine = byte_engine(0)
    cfg = FinetuneConfig(domain="kjv", examples=6, rank=4, steps=6, batch=2, lr=3e-3, eval_every=3, heldout=2)
    summary = finetune(engine, cfg, tmp_path / "ft", "byte", log=lambda *_: None)
    losses = [h["heldout_loss"] for h in summary["history"]]
    assert losses[-1] < losses[0] and summary["trainable_parameters"] == sum(
        4 * (a + b) for a, b in [(64, 128), (64, 64), (64, 192), (96, 64)]) * 2
    merged = [p.clone() for p in engine.model.parameters()]
    fresh = byte_engine(0)
    apply_adapter(fresh.model, tmp_path / "ft")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(merged, fresh.model.parameters()))
    # a finished run resumes at its end: nothing more to do, the same adapter
    again = finetune(byte_engine(0), cfg, tmp_path / "ft", "byte", log=lambda *_: None)
    assert again["heldout_loss"] == pytest.approx(summary["heldout_loss"])
    assert again["history"][0] == summary["history"][0]  # the base model's loss, kept in the checkpoint
    with pytest.raises(SparseSpecError, match="other settings"):
        finetune(byte_engine(0), FinetuneConfig(domain="shakespeare", examples=6, rank=4, steps=6, batch=2),
                 tmp_path / "ft", "byte", log=lambda *_: None)


@pytest.fixture(scope="module")
def shifted():
    """A base target and a 'fine-tuned' one (its last MLP and LM head moved), each with its own greedy answers to
    the same prompts; a base drafter trained on the base target's answers."""
    base = tiny_engine(5, vocab=48, scale=4.0)
    tuned = tiny_engine(5, vocab=48, scale=4.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (*tuned.model.layers[-1].mlp.parameters(), tuned.model.lm_head.weight):
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (112,), generator=g)]
    taps = (0, 1)
    torch.manual_seed(0)
    drafter = DFlash(DFlashConfig(base.config, layers=1, block_size=4, taps=taps))
    fit(drafter, base.model, regenerate(base, prompts[:80], taps, 40, 16), regenerate(base, prompts[80:96], taps, 40, 16),
        TrainConfig(steps=250, batch=8, anchors=16, block_size=4, lr=3e-3, eval_every=250), log=lambda *_: None)
    return base, tuned, drafter.eval().requires_grad_(False), prompts, taps


def test_a_decoupled_drafter_drafts_as_its_base_and_trains_only_its_private_part(shifted):
    base_target, tuned, base, prompts, taps = shifted
    drafter = decouple(base, private_size=16)
    assert drafter.cfg.private_size == 16 and DFlashConfig.from_json(drafter.cfg.to_json()) == drafter.cfg
    assert "private_size" not in base.cfg.to_json()  # drafter files from before EDA keep their json
    held = regenerate(tuned, prompts[96:], taps, 40, 16)
    assert acceptance(drafter.eval(), tuned.model, held) == pytest.approx(acceptance(base, tuned.model, held))
    trainable, total = adapt_parameters(drafter, train_fc=False)
    private = sum(p.numel() for layer in drafter.layers for p in layer.mlp.private.parameters())
    assert trainable == private and total == private + sum(p.numel() for p in base.parameters())
    assert adapt_parameters(drafter, train_fc=True)[0] == private + drafter.fc.weight.numel()
    adapt_parameters(drafter, train_fc=False)
    frozen = {n: p.clone() for n, p in drafter.named_parameters() if not p.requires_grad}
    data = regenerate(tuned, prompts[:80], taps, 40, 16)
    before = acceptance(base, tuned.model, held)
    tau, _ = fit(drafter, tuned.model, data, held, TrainConfig(steps=150, batch=8, anchors=16, block_size=4, lr=3e-3,
                                                             eval_every=150), log=lambda *_: None)
    assert all(torch.equal(p, frozen[n]) for n, p in drafter.named_parameters() if n in frozen)
    assert tau > before + 0.1, (before, tau)
    # the adapted drafter is a drafter like any other: saved, loaded, lossless in the loop
    prompt = held.sequence(0)[:int(held.starts[0])]
    gen = GenerationConfig(max_new_tokens=30)
    out = speculative_generate(tuned, [prompt], DFlashDrafter(drafter.eval(), tuned.model), gen, 4)[0]
    assert out.token_ids == tuned.generate([prompt], gen).token_ids[0]
    with pytest.raises(SparseSpecError, match="already decoupled"):
        decouple(drafter, 8)


def test_selection_by_loss_or_acceptance_keeps_the_samples_the_base_drafter_gets_wrong(shifted):
    """Half the samples are the base target's answers (which its drafter knows), half the fine-tuned target's: the
    loss, reducible, acceptance and shift rules keep mostly the latter, random keeps about half of each."""
    base_target, tuned, base, prompts, taps = shifted
    old = regenerate(base_target, prompts[:40], taps, 40, 16)
    new = regenerate(tuned, prompts[40:80], taps, 40, 16)
    both = Dataset(torch.cat([old.tokens, new.tokens]), torch.cat([old.offsets, new.offsets[1:] + old.offsets[-1]]),
                   torch.cat([old.starts, new.starts]), torch.cat([old.features, new.features]))
    for rule in ("loss", "reducible", "acceptance", "shift", "random"):
        scores = sample_scores(base, tuned.model, both, rule, anchors=16, reference=base_target.model)
        kept = torch.sort(scores, descending=True, stable=True).indices[:40]
        share_new = float((kept >= 40).float().mean())
        assert share_new > 0.8 if rule != "random" else 0.25 < share_new < 0.75, (rule, share_new)
    chosen = select(both, scores, 0.25)
    assert len(chosen) == 20
    order = torch.sort(scores, descending=True, stable=True).indices[:20]
    for i, r in enumerate(order.tolist()):  # packed anew, each sequence with its own features
        assert chosen.sequence(i) == both.sequence(r) and int(chosen.starts[i]) == int(both.starts[r])
        lo, hi = int(chosen.offsets[i]), int(chosen.offsets[i + 1])
        assert torch.equal(chosen.features[lo:hi], both.features[int(both.offsets[r]):int(both.offsets[r + 1])])


def test_target_nll_is_each_rows_own_next_token_loss():
    engine = tiny_engine(5)
    lengths = torch.tensor([9, 4, 1, 7])
    tokens = torch.randint(0, 64, (4, 9))
    got = target_nll(engine.model, tokens, lengths, chunk=3)  # chunks of 3 over 8 positions: the last one short
    for r, n in enumerate(lengths.tolist()):
        row = tokens[r:r + 1, :n]  # alone, unpadded
        logp = engine.model.logits(_forward(engine.model, row))[0, :-1].log_softmax(-1)
        want = -logp.gather(-1, row[0, 1:, None])[:, 0]
        torch.testing.assert_close(got[r, :n - 1], want, rtol=1e-5, atol=1e-5)
        assert not got[r, n - 1:].any()  # no next token at a row's end, nothing past it


def test_scores_do_not_depend_on_how_many_samples_are_scored_at_once(shifted):
    """The default batch (`scoring_rows`: as many samples as fit the memory budget) scores as one sample at a time
    does: on the CPU the anchors come from one generator stream either way, and the rows are independent."""
    from sparsespec.spec.eda import scoring_rows

    _, tuned, base, prompts, taps = shifted
    data = regenerate(tuned, prompts[:7], taps, 20, 8)
    assert scoring_rows(8, base.cfg.block_size, base.cfg.target.vocab_size, torch.device("cpu")) >= 7
    assert scoring_rows(32, 16, 151936, torch.device("cpu")) == 3  # the 1.5B's blocks: 311 MB a sample in 1 GiB
    assert scoring_rows(10**6, 16, 151936, torch.device("cpu")) == 1
    together = sample_scores(base, tuned.model, data, "loss", anchors=8, seed=5)  # (a continuous score: no argmax
    alone = sample_scores(base, tuned.model, data, "loss", anchors=8, seed=5, batch=1)  # ties to break either way)
    assert torch.allclose(together, alone, rtol=1e-4, atol=1e-5)


def test_reducible_score_is_the_loss_score_less_the_targets_own_loss_on_the_same_labels(shifted):
    from sparsespec.spec.dflash import block_labels, loss_weights
    from sparsespec.spec.train import sample_anchors

    _, tuned, base, prompts, taps = shifted
    data = regenerate(tuned, prompts[:6], taps, 20, 8)
    loss = sample_scores(base, tuned.model, data, "loss", anchors=8, seed=3, batch=4)
    reducible = sample_scores(base, tuned.model, data, "reducible", anchors=8, seed=3, batch=4)
    g = torch.Generator().manual_seed(3)  # the anchors both drew: batches of 4 rows, 8 blocks a row
    B = base.cfg.block_size
    for lo in range(0, len(data), 4):
        rows = torch.arange(lo, min(lo + 4, len(data)))
        anchors = sample_anchors(data, rows, 8, g)
        for j, r in enumerate(rows.tolist()):
            seq = torch.tensor([data.sequence(r)])
            logp = tuned.model.logits(_forward(tuned.model, seq))[0, :-1].log_softmax(-1)
            nll = -logp.gather(-1, seq[0, 1:, None])[:, 0]
            labels = block_labels(seq, anchors[j:j + 1], torch.tensor([seq.shape[1]]), B)[0]  # [8, B]
            w = loss_weights(B).expand_as(labels) * (labels >= 0)
            pos = (anchors[j, :, None] + torch.arange(B) - 1).clamp(0, len(nll) - 1)
            expect = float((w * nll[pos]).sum() / w.sum())
            assert abs(float(loss[r] - reducible[r]) - expect) < 1e-4, (r, float(loss[r] - reducible[r]), expect)


def test_shift_score_is_the_base_targets_answer_loss_less_the_fine_tuned_targets(shifted):
    """Each sample alone: the mean over its answer tokens of −log p_base(token) + log p_tuned(token); batched and
    padded as the selection runs it. Without the base target the rule refuses, before any data is made."""
    base_target, tuned, base, prompts, taps = shifted
    data = regenerate(tuned, prompts[:7], taps, 20, 8)
    got = sample_scores(base, tuned.model, data, "shift", anchors=8, reference=base_target.model)
    for r in range(len(data)):
        seq = torch.tensor([data.sequence(r)])
        start = int(data.starts[r])

        def nll(model):
            logp = model.logits(_forward(model, seq))[0, :-1].log_softmax(-1)
            return -logp.gather(-1, seq[0, 1:, None])[:, 0][start - 1:]  # the losses of the answer's tokens

        want = float((nll(base_target.model) - nll(tuned.model)).mean())
        assert abs(float(got[r]) - want) < 1e-4, (r, float(got[r]), want)
    assert float(got.mean()) > 0  # the tuned target's own greedy answers: likelier under it than under the base
    with pytest.raises(SparseSpecError, match="fine-tune"):
        sample_scores(base, tuned.model, data, "shift", anchors=8)


@pytest.mark.parametrize("data", ["regenerated", "original"])
def test_train_eda_end_to_end_writes_a_drafter_the_loop_uses_and_resumes(tmp_path, data):
    engine = byte_engine(0)
    torch.manual_seed(0)
    base = DFlash(DFlashConfig(engine.config, layers=1, block_size=4, taps=(0, 1)))
    base.save(tmp_path / "base", dtype=torch.float32, meta={"heldout_tau": 1.0})
    cfg = EdaConfig(domain="shakespeare", data=data, select="acceptance", fraction=0.5, private_size=8,
                    score_anchors=4)
    tcfg = TrainConfig(prompts=6, heldout=2, max_new_tokens=12, gen_batch=4, steps=4, batch=2, anchors=4,
                       eval_every=2, kinds=("shakespeare",))
    summary = train_eda(engine, tmp_path / "base", cfg, tcfg, tmp_path / "run", "byte", log=lambda *_: None)
    assert summary["samples"] == 6 and summary["kept"] == 3 and summary["trainable_parameters"] == 64 * 2 * 8 + 8 * 64
    adapted = DFlash.load(tmp_path / "run" / "drafter")
    assert adapted.cfg.private_size == 8
    meta = json.loads((tmp_path / "run" / "drafter.json").read_text())
    assert "train eda" in meta["made_by"] and "--domain shakespeare" in meta["made_by"]
    assert meta["base_drafter"] == str(tmp_path / "base")
    prompt = engine.encode("Continue this scene.\n\nTo be, or not to be", chat=True)
    gen = GenerationConfig(max_new_tokens=10)
    assert speculative_generate(engine, [prompt], DFlashDrafter(adapted, engine.model), gen, 4)[0].token_ids == \
        engine.generate([prompt], gen).token_ids[0]
    again = train_eda(engine, tmp_path / "base", cfg, tcfg, tmp_path / "run", "byte", log=lambda *_: None)
    assert again["heldout_tau"] == pytest.approx(summary["heldout_tau"])
    for key in ("heldout_tau_decoding", "base_heldout_tau_decoding"):  # tokens per verify step, 1 to the block
        assert 1 <= summary[key] <= 4 and again[key] == pytest.approx(summary[key])
    with pytest.raises(SparseSpecError, match="other settings"):
        train_eda(engine, tmp_path / "base", EdaConfig(domain="shakespeare", data=data, select="random"), tcfg,
                  tmp_path / "run", "byte", log=lambda *_: None)
    with pytest.raises(SparseSpecError, match="another target"):
        train_eda(tiny_engine(0), tmp_path / "base", cfg, tcfg, tmp_path / "other", "tiny", log=lambda *_: None)
    shift = EdaConfig(domain="shakespeare", data=data, select="shift")
    with pytest.raises(SparseSpecError, match="none was given"):  # refused before any answer is generated
        train_eda(engine, tmp_path / "base", shift, tcfg, tmp_path / "shift", "byte", log=lambda *_: None)
    with pytest.raises(SparseSpecError, match="another shape"):
        train_eda(engine, tmp_path / "base", shift, tcfg, tmp_path / "shift", "byte", log=lambda *_: None,
                  reference=tiny_engine(0).model)
    assert not (tmp_path / "shift" / "data.safetensors").exists()


@pytest.mark.parametrize("rule", ["loss", "random"])
def test_probe_selection_answers_only_the_prompts_whose_probes_score_highest(tmp_path, rule):
    """--probe-tokens: every prompt answered with a few tokens, the probes scored by the rule (random: no probes), and
    only the top fraction of the prompts answered in full and trained on; a resumed run keeps them."""
    from sparsespec.spec.eda import choose_prompts, random_scores, top
    from sparsespec.spec.prompts import make_prompts

    engine = byte_engine(0)
    torch.manual_seed(0)
    base = DFlash(DFlashConfig(engine.config, layers=1, block_size=4, taps=(0, 1)))
    base.save(tmp_path / "base", dtype=torch.float32, meta={"heldout_tau": 1.0})
    cfg = EdaConfig(domain="kjv", select=rule, fraction=0.4, private_size=8, score_anchors=4, probe_tokens=5)
    tcfg = TrainConfig(prompts=7, heldout=2, max_new_tokens=12, gen_batch=4, steps=2, batch=2, anchors=4,
                       eval_every=2, kinds=("kjv",))
    prompts = [engine.encode(p.text, chat=True) for p in make_prompts(7, "train", ("kjv",), 0)]
    if rule == "random":
        expect = random_scores(7, 0, engine.device)
    else:
        probes = regenerate(engine, prompts, base.cfg.taps, 5, 4)
        assert all(int(n) - int(s) <= 5 for n, s in zip(probes.lengths, probes.starts))
        expect = sample_scores(base, engine.model, probes, rule, 4, 0)
    keep = top(expect, 0.4)
    assert len(keep) == 3
    summary = train_eda(engine, tmp_path / "base", cfg, tcfg, tmp_path / "run", "byte", log=lambda *_: None)
    assert summary["samples"] == 7 and summary["kept"] == 3 and "--probe-tokens 5" in summary["made_by"]
    data = Dataset.load(tmp_path / "run" / "data.safetensors", engine, base.cfg.taps, 4)
    assert [data.sequence(i)[:int(data.starts[i])] for i in range(3)] == [prompts[i] for i in keep.tolist()]
    full = engine.generate([prompts[i] for i in keep.tolist()], GenerationConfig(max_new_tokens=12)).token_ids
    assert [data.sequence(i)[int(data.starts[i]):] for i in range(3)] == full  # answered in full
    torch.testing.assert_close(choose_prompts(engine, base, prompts, cfg, tcfg, tmp_path / "run" / "scores.pt")[0],
                               keep)  # the saved scores
    again = train_eda(engine, tmp_path / "base", cfg, tcfg, tmp_path / "run", "byte", log=lambda *_: None)
    assert again["kept"] == 3 and again["heldout_tau"] == pytest.approx(summary["heldout_tau"])
    with pytest.raises(SparseSpecError, match="only regenerated data is probed"):
        EdaConfig(data="original", probe_tokens=5)


def test_a_mixed_pool_answers_general_prompts_beside_the_domains_in_train_and_held_out_alike(tmp_path):
    """--mix F: a share F of the prompts (train and held-out) is general code and text, the rest the domain's; the
    run answers exactly those, and selects among all of them; refused for the original text (it has no general
    prompts) and for F outside [0, 1)."""
    from sparsespec.spec.eda import pool_prompts
    from sparsespec.spec.prompts import make_prompts

    cfg = EdaConfig(domain="kjv", select="loss", fraction=0.5, private_size=8, score_anchors=4, mix=0.25)
    pool = pool_prompts(cfg, 8, "train", 0)
    assert pool[:6] == [p.text for p in make_prompts(6, "train", ("kjv",), 0)]
    assert pool[6:] == [p.text for p in make_prompts(2, "train", ("code", "text"), 0)]
    assert pool_prompts(EdaConfig(domain="kjv"), 8, "train", 0) == [p.text for p in make_prompts(8, "train", ("kjv",), 0)]
    assert len(pool_prompts(EdaConfig(domain="kjv", mix=0.9), 1, "heldout", 0)) == 1
    engine = byte_engine(0)
    torch.manual_seed(0)
    DFlash(DFlashConfig(engine.config, layers=1, block_size=4, taps=(0, 1))).save(
        tmp_path / "base", dtype=torch.float32, meta={"heldout_tau": 1.0})
    tcfg = TrainConfig(prompts=8, heldout=4, max_new_tokens=6, gen_batch=4, steps=2, batch=2, anchors=4,
                       eval_every=2, kinds=("kjv",))
    summary = train_eda(engine, tmp_path / "base", cfg, tcfg, tmp_path / "run", "byte", log=lambda *_: None)
    assert summary["samples"] == 8 and summary["kept"] == 4 and "--mix 0.25" in summary["made_by"]
    for name, split, n in (("data", "train", 8), ("heldout", "heldout", 4)):
        data = Dataset.load(tmp_path / "run" / f"{name}.safetensors", engine, (0, 1), 4)
        asked = [engine.encode(t, chat=True) for t in pool_prompts(cfg, n, split, 0)]
        assert [data.sequence(i)[:int(data.starts[i])] for i in range(n)] == asked
    for bad in (dict(mix=1.0), dict(mix=-0.1), dict(mix=0.5, data="original")):
        with pytest.raises(SparseSpecError, match="mix must be in"):
            EdaConfig(**bad)


def test_cli_train_eda_and_finetune_refuse_bad_options_with_one_line(tmp_path, capsys):
    from sparsespec.cli import main

    DFlash(DFlashConfig(byte_engine(0).config, layers=1, block_size=4, taps=(0, 1))).save(
        tmp_path / "base", dtype=torch.float32, meta={})

    for argv in (["train", "eda", "--target", "x", "--base-drafter", str(tmp_path / "none"), "--domain", "kjv",
                  "--out", str(tmp_path / "r")],
                 ["train", "eda", "--target", "x", "--base-drafter", "b", "--domain", "kjv", "--out", "r",
                  "--fraction", "1.5"],
                 ["train", "eda", "--target", "x", "--base-drafter", str(tmp_path / "base"), "--domain", "kjv",
                  "--out", str(tmp_path / "m"), "--mix", "1"],
                 ["train", "finetune", "--domain", "kjv", "--out", str(tmp_path / "f"), "--alpha", "-1"],
                 ["train", "eda", "--target", "x", "--base-drafter", str(tmp_path / "base"), "--domain", "kjv",
                  "--out", str(tmp_path / "s"), "--select", "shift"]):  # shift needs a fine-tune, not any model
        assert main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("sparsespec"), err


@pytest.mark.parametrize("domain", ["kjv", "shakespeare"])
def test_domain_pairs_continue_their_source_text_and_keep_train_and_heldout_documents_apart(domain):
    from sparsespec import corpora
    from sparsespec.spec.prompts import domain_pairs, make_prompts

    train = domain_pairs(domain, 40, "train", seed=3)
    assert train == domain_pairs(domain, 40, "train", seed=3) and len({p for p, _ in train}) == 40
    held = domain_pairs(domain, 20, "heldout", seed=3)
    title = (lambda prompt: prompt.split("(", 1)[1].split(")", 1)[0]) if domain == "kjv" else (
        lambda prompt: prompt.split("Shakespeare's ", 1)[1].split(".\n", 1)[0])
    assert not {title(p) for p, _ in train} & {title(p) for p, _ in held}
    sep = " " if domain == "kjv" else "\n"
    source = [" ".join(d.split()) for d in corpora.documents(domain)]
    for prompt, answer in train[:5] + held[:5]:  # the continuation is the text that follows the prompt's passage
        passage = " ".join(prompt.split("\n\n", 1)[1].split())
        assert any(passage + " " + " ".join(answer.split()) in doc for doc in source)
        assert sep in answer
    assert [p.text for p in make_prompts(6, "heldout", (domain,), seed=3)] == [p for p, _ in held[:6]]


def test_eda_curves_costs_runs_that_reused_answers_at_the_answering_runs_price_and_plots(tmp_path, capsys):
    """bench/eda_curves.py over a table's run folders: a regenerated EDA run that reused another run's answers is
    charged that run's answer seconds, the original-text run and the retrain their own; a retrain's trainable
    parameters are its whole drafter's; every run's evaluations become points of the plot."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "bench" / "eda_curves.py"
    spec = importlib.util.spec_from_file_location("eda_curves", path)
    curves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curves)
    cfg = DFlashConfig(tiny_engine(0).config, layers=1, block_size=4, taps=(0, 1))
    history = [{"step": 10, "loss": 3.0, "heldout_tau": 1.5, "seconds": 5.0},
               {"step": 20, "loss": 2.0, "heldout_tau": 1.8, "seconds": 10.0}]
    runs = {"loss": ("regenerated", 40.0, 3.0), "random": ("regenerated", 2.0, 0.0), "original": ("original", 7.0, 3.0)}
    for name, (data, data_s, score_s) in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({
            "eda": {"data": data}, "trainable_parameters": 123, "data_seconds": data_s, "score_seconds": score_s,
            "train_seconds": 11.0, "heldout_tau": 1.8, "heldout_tau_decoding": 1.6, "base_heldout_tau": 1.2,
            "history": history}))
    (tmp_path / "retrain").mkdir()
    (tmp_path / "retrain" / "summary.json").write_text(json.dumps({
        "data_seconds": 41.0, "train_seconds": 30.0, "heldout_tau": 1.9, "heldout_tau_decoding": 1.7,
        "history": history}))
    (tmp_path / "retrain" / "drafter.json").write_text(json.dumps({"config": cfg.to_json()}))
    loaded = curves.load_runs(tmp_path, "loss")
    assert {n: r["answer_s"] for n, r in loaded.items()} == {"loss": 40.0, "original": 7.0, "random": 40.0,
                                                            "retrain": 41.0}
    assert loaded["loss"]["curve"] == [(48.0, 1.5), (53.0, 1.8)]
    assert loaded["retrain"]["trainable"] == sum(p.numel() for p in DFlash(cfg).parameters())
    assert loaded["random"]["trainable"] == 123
    curves.main([str(tmp_path), "--answers", "loss"])
    out = capsys.readouterr().out
    assert "| random | 123 | 40.0 + 0.0 + 11.0 = 51 | 1.60 | 1.80 |" in out
    assert (tmp_path / "tau_curves.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no such run"):
        curves.load_runs(tmp_path, "nope")
