"""Input checks a new user meets: a tap count that would tap a layer twice, a resume past the run's steps, a LoRA
rank above the adapted maps' widths, a calibrated BinaryPC basis of another bit width — each refused in one line
(exit 2 from the CLI) before any work, never a silent waste or a misleading message."""

import json

import pytest
import torch

from sparsespec.errors import SparseSpecError
from sparsespec.spec import train
from sparsespec.spec.dflash import DFlash, DFlashConfig, default_taps
from sparsespec.spec.train import TrainConfig, fit, regenerate

from .conftest import byte_engine
from .test_spec import tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(argv, capsys) -> tuple[int, list[str]]:
    from sparsespec.cli import main

    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def _refused(argv, capsys) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    code, err = _cli(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("sparsespec: error:"), (code, err)
    return err[0]


# ------------------------------------------------------------------------------------------------- 1. taps


def test_default_taps_never_tap_a_layer_twice_and_keep_the_spread_where_it_fitted():
    """Any count up to the target's depth gives that many distinct layers; counts the second-to-fourth-last range
    holds keep the old spread (settings.json of earlier runs still match on resume)."""
    def old(L, n):  # the spread before: round(linspace(1, L − 3, n))
        if n == 1:
            return (L // 2,)
        hi = max(1, L - 3)
        return tuple(round(1 + i * (hi - 1) / (n - 1)) for i in range(n))

    for L in range(1, 129):
        for n in range(1, L + 1):
            taps = default_taps(L, n)
            assert len(set(taps)) == n and all(0 <= t < L for t in taps) and list(taps) == sorted(taps), (L, n, taps)
            if n <= max(1, L - 3):
                assert taps == old(L, n), (L, n)
    assert default_taps(2, 2) == (0, 1) and len(set(default_taps(30, 28))) == 28
    assert DFlashConfig(byte_engine(0).config).taps == (0, 1)  # the default 3 taps on a 2-layer target: both once
    with pytest.raises(SparseSpecError, match="at most 2"):
        default_taps(2, 3)


def test_train_dflash_taps_distinct_layers_and_refuses_more_taps_than_layers(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["--target", "random:tiny", "--prompts", "2", "--heldout", "1", "--max-new-tokens", "4", "--gen-batch",
             "2", "--batch", "1", "--anchors", "2", "--block-size", "2", "--eval-every", "1", "--out", str(out)]
    line = _refused(["train", "dflash", *small, "--taps", "3", "--steps", "1"], capsys)
    assert "at most 2" in line, line
    assert not (out / "settings.json").exists()
    code, err = _cli(["train", "dflash", *small, "--taps", "2", "--steps", "2"], capsys)
    assert code == 0, err
    assert json.loads((out / "settings.json").read_text())["drafter"]["taps"] == [0, 1]

    # 2. a resume into a run past --steps is refused before the data is loaded; nothing is rewritten
    summary = (out / "summary.json").read_bytes()
    drafter = (out / "drafter.safetensors").read_bytes()
    line = _refused(["train", "dflash", *small, "--taps", "2", "--steps", "1"], capsys)
    assert f"the checkpoint in {out} is at step 2, past --steps 1: pass --steps above 2" in line, line
    assert (out / "summary.json").read_bytes() == summary and (out / "drafter.safetensors").read_bytes() == drafter
    assert "NaN" not in summary.decode()
    # the same command again (the run finished): its results as they were, no NaN re-evaluation row
    code, err = _cli(["train", "dflash", *small, "--taps", "2", "--steps", "2"], capsys)
    assert code == 0, err
    again = json.loads((out / "summary.json").read_text())
    assert again["history"] == json.loads(summary)["history"] and "NaN" not in (out / "summary.json").read_text()
    assert (out / "drafter.safetensors").read_bytes() == drafter


# ------------------------------------------------------------------------------------------- 2. resume past steps


@pytest.fixture(scope="module")
def small_data():
    target = tiny_engine(5, vocab=48, scale=4.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (6,), generator=g).tolist() for _ in range(6)]
    return target, regenerate(target, prompts[:4], (0, 1), 8, 4), regenerate(target, prompts[4:], (0, 1), 8, 4)


def test_fit_refuses_a_checkpoint_past_its_steps(small_data, tmp_path):
    target, data, held = small_data
    cfg = TrainConfig(steps=3, batch=2, anchors=2, block_size=4, eval_every=10)
    fit(DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=(0, 1))), target.model, data, held, cfg,
        tmp_path / "checkpoint.pt", log=lambda *_: None)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with pytest.raises(SparseSpecError, match=r"is at step 3, past --steps 2: pass --steps above 3"):
        fit(DFlash(DFlashConfig(target.config, layers=1, block_size=4, taps=(0, 1))), target.model, data, held,
            TrainConfig(steps=2, batch=2, anchors=2, block_size=4, eval_every=10), tmp_path / "checkpoint.pt",
            log=lambda *_: None)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


def test_train_eda_refuses_to_resume_past_its_steps_before_any_data(tmp_path):
    from sparsespec.spec.eda import EdaConfig, train_eda

    engine = byte_engine(0)
    DFlash(DFlashConfig(engine.config, layers=1, block_size=4, taps=(0, 1))).save(
        tmp_path / "base", dtype=torch.float32, meta={"heldout_tau": 1.0})
    (tmp_path / "run").mkdir()
    torch.save({"model": {}, "opt": {}, "step": 5, "seconds": 1.0}, tmp_path / "run" / "checkpoint.pt")
    tcfg = TrainConfig(prompts=2, heldout=1, max_new_tokens=4, gen_batch=2, steps=2, batch=1, anchors=2,
                       eval_every=1, kinds=("kjv",))
    with pytest.raises(SparseSpecError, match=r"is at step 5, past --steps 2: pass --steps above 5"):
        train_eda(engine, tmp_path / "base", EdaConfig(domain="kjv", private_size=8), tcfg, tmp_path / "run",
                  "byte", log=lambda *_: None)
    assert not (tmp_path / "run" / "data.safetensors").exists()


# ---------------------------------------------------------------------------------------------- 3. LoRA rank


def test_finetune_refuses_a_rank_above_the_adapted_maps_widths(tmp_path, capsys):
    from sparsespec.spec.finetune import FinetuneConfig, add_lora, finetune

    engine = byte_engine(0)  # hidden 64, MLP 96: the narrowest adapted map is 64 wide
    with pytest.raises(SparseSpecError, match="LoRA rank must be <= 64"):
        finetune(engine, FinetuneConfig(examples=2, rank=65, steps=1, batch=1, heldout=1), tmp_path / "ft", "byte",
                 log=lambda *_: None)
    assert not (tmp_path / "ft").exists()
    with pytest.raises(SparseSpecError, match="LoRA rank must be <= 64"):
        add_lora(engine.model, 100000, 32.0)
    assert len(add_lora(byte_engine(0).model, 64, 32.0)) == 8  # the limit itself is allowed
    line = _refused(["train", "finetune", "--model", "random:tiny", "--domain", "kjv", "--rank", "100000",
                     "--out", str(tmp_path / "cli")], capsys)
    assert "LoRA rank must be <= " in line and "100000" in line, line
    assert not (tmp_path / "cli" / "checkpoint.pt").exists()


# -------------------------------------------------------------------------------------------- 4. BinaryPC basis


def test_a_basis_of_another_bit_width_is_refused_naming_both_widths(tmp_path, capsys):
    from safetensors.torch import save_file

    from sparsespec.attention import make_policy
    from sparsespec.attention.binarypc import fit_calibrated_basis

    g = torch.Generator().manual_seed(0)
    keys = {layer: torch.randn(2, 32, 16, generator=g) for layer in range(2)}
    save_file(fit_calibrated_basis(keys, bits=3, iters=2), str(tmp_path / "cal.safetensors"))
    with pytest.raises(SparseSpecError, match=r"holds a 3-bit basis and the policy asks for 64 bits: pass bits=3"):
        make_policy("binarypc", {"basis": str(tmp_path / "cal.safetensors")})
    assert make_policy("binarypc", {"basis": str(tmp_path / "cal.safetensors"), "bits": 3}).options.bits == 3
    line = _refused(["generate", "--model", "random:tiny", "--prompt", "Hi", "--max-new-tokens", "2", "--attention",
                     f"binarypc:basis={tmp_path / 'cal.safetensors'},dense_layers=0,min_tokens=1"], capsys)
    assert "3-bit basis" in line and "pass bits=3" in line, line


def test_finetune_refuses_to_resume_past_its_steps_before_any_work(tmp_path):
    from sparsespec.spec.finetune import FinetuneConfig, finetune

    (tmp_path / "ft").mkdir()
    torch.save({"params": [], "opt": {}, "step": 5, "seconds": 1.0, "history": []}, tmp_path / "ft" / "checkpoint.pt")
    with pytest.raises(SparseSpecError, match=r"is at step 5, past --steps 2: pass --steps above 5"):
        finetune(byte_engine(0), FinetuneConfig(examples=2, rank=4, steps=2, batch=1, heldout=1), tmp_path / "ft",
                 "byte", log=lambda *_: None)
    assert not (tmp_path / "ft" / "settings.json").exists()


# ------------------------------------------------------------------------------------------- long prompts' size


def test_train_dflash_sizes_its_long_prompts_and_refuses_a_size_without_them(tmp_path, capsys):
    """--long-chars sizes the long kinds' contexts (64,000 characters before: past a small target's context, so no
    long-kind training could run on it); without a long kind it would be ignored: refused."""
    with pytest.raises(SparseSpecError, match="add one"):
        TrainConfig(long_chars=2000)
    with pytest.raises(SparseSpecError, match=">= 1000"):
        TrainConfig(kinds=("long-code",), long_chars=999)
    out = tmp_path / "run"
    code, err = _cli(["train", "dflash", "--target", "random:tiny", "--kinds", "long-code", "--long-chars", "2000",
                      "--prompts", "2", "--heldout", "1", "--max-new-tokens", "4", "--gen-batch", "2", "--batch", "1",
                      "--anchors", "2", "--block-size", "2", "--eval-every", "1", "--taps", "2", "--steps", "1",
                      "--out", str(out)], capsys)
    assert code == 0, err
    assert json.loads((out / "settings.json").read_text())["data"]["long_chars"] == 2000


def test_a_row_cut_short_is_measured_again_and_a_damaged_results_file_is_one_line(tmp_path):
    """A run stopped while writing a row leaves it without its newline: the rows before it are read, the torn one
    is left out (the resumed run measures it again) and cut off before the next row is appended, so the file stays
    one row a line. A damaged line elsewhere, a line that is no object, or a settings record that is no object is
    refused in one line, not a traceback."""
    from sparsespec.results import _recorded, append_rows, read_rows

    path = tmp_path / "results.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b": "cut sh')
    assert read_rows(path) == [{"a": 1}, {"a": 2}]
    with append_rows(path) as sink:
        sink.write(json.dumps({"a": 3}) + "\n")
    assert read_rows(path) == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n{"a": 3}\n'
    path.write_text('{"a": 1}\n{"a": 2}')  # whole, only its newline lost: read, kept, and ended
    assert read_rows(path) == [{"a": 1}, {"a": 2}]
    with append_rows(path) as sink:
        sink.write(json.dumps({"a": 3}) + "\n")
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n{"a": 3}\n'
    for text, needle in (('{"a": 1}\n{"a": \n{"a": 3}\n', "line 2, is not a JSON row"),
                         ('{"a": 1}\n42\n', "line 2, is not a JSON object")):
        path.write_text(text)
        with pytest.raises(SparseSpecError, match=needle):
            read_rows(path)
    path.write_text('{"a": 1}\n')
    for record in ("[]", "{not json"):
        (tmp_path / "results.settings.json").write_text(record)
        with pytest.raises(SparseSpecError, match="is not a record of settings"):
            _recorded(tmp_path, ("results.jsonl",))


def test_a_drafter_json_without_its_config_says_so(tmp_path):
    from sparsespec.spec.dflash import drafter_files

    weights, meta = drafter_files(tmp_path / "d")
    weights.write_bytes(b"")
    meta.write_text("{}")
    with pytest.raises(SparseSpecError, match="corrupt DFlash drafter .*: no 'config' in d.json"):
        DFlash.load(tmp_path / "d")
