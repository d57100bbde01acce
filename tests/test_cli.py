"""The CLI: JSON output, the model list, and a clear one-line error (exit 2, no traceback) for each bad input."""

import io
import json
import shutil
import subprocess
import sys

import pytest

from sparsespec.cli import main

from .conftest import tiny_hf_model


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clear_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsespec: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "1.5", "--temperature", "1"], "top-p must be in"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "positive integer"),
    (["generate", "--prompt", "hi", "--device", "tpu"], "invalid choice"),
    (["generate", "--prompt", "hi", "--dtype", "int3"], "invalid choice"),
    (["generate"], "required"),
    (["generate", "--prompt", "hi", "--model", "no-such-model"], "model not found"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["generate", "--prompts-file", "/nonexistent/prompts.jsonl"], "cannot read prompt file"),
    (["generate", "--prompt", "hi", "--system", "Be brief."], "--chat"),
    (["generate", "--prompt", "hi", "--attention-opt", "budget=0.5"], "sparse --attention"),
    (["generate", "--prompt", "hi", "--attention", "dense:budget=0.5"], "sparse --attention"),
    (["generate", "--prompt", "hi", "--stop-token-ids", "2,x"], "comma-separated token ids"),
    (["generate", "--prompt", "hi", "--block-size", "4"], "--block-size applies to speculative decoding"),
    # options that would be silently ignored: refused before the model loads
    (["generate", "--prompt", "hi", "--top-k", "5"], "add --temperature above 0"),
    (["generate", "--prompt", "hi", "--top-p", "0.5"], "add --temperature above 0"),
    (["generate", "--prompt", "hi", "--seed", "3"], "add --temperature above 0"),
    (["generate", "--prompt", "hi", "--target-name", "smollm2-135m"], "give --draft"),
    (["generate", "--prompt", "hi", "--target-name", "qwen2.5-coder-0.5b", "--draft", "ngram"],
     "--draft ngram uses none"),
    (["generate", "--prompt", "hi", "--target-name", "qwen2.5-coder-0.5b", "--draft", "dflash:some/drafter"],
     "--draft dflash:some/drafter uses none"),
    (["generate", "--prompt", "hi", "--compile"], "needs --device cuda"),
    (["bench", "spec", "--target", "no-such-model", "--compile"], "needs --device cuda"),
    (["bench", "spec", "--target", "no-such-model", "--temperatures", "0,0"], "--temperatures lists 0.0 twice"),
    (["bench", "spec", "--target", "no-such-model", "--kinds", "code,text,code"], "--kinds lists code twice"),
    (["bench", "spec", "--target", "no-such-model", "--out", ""], "path is empty"),
    (["train", "dflash", "--target", "no-such-model", "--out", ""], "path is empty"),
    (["calibrate", "binarypc", "--model", "no-such-model", "--out", ""], "names no file"),
    (["calibrate", "binarypc", "--model", "no-such-model", "--out", "/tmp/sub/"], "names no file"),
    (["calibrate", "doublesparse", "--model", "no-such-model", "--bits", "8", "--out", "x.safetensors"],
     "--bits is the binarypc calibration's option"),
    (["calibrate", "binarypc", "--model", "no-such-model", "--channels", "8", "--out", "x.safetensors"],
     "--channels is the doublesparse calibration's option"),
    (["fidelity", "--model", "no-such-model", "--contexts", "natural,natural"], "--contexts lists natural twice"),
    (["fidelity", "--model", "no-such-model", "--attention", "topk:budget=0.5"], "sweeps the budget"),
    (["fidelity", "--model", "no-such-model", "--attention", "topk", "--attention-opt", "topk.budget=0.5"],
     "sweeps the budget"),
    (["longgen", "--model", "no-such-model", "--kinds", "long-essay,long-essay"], "--kinds lists long-essay twice"),
    (["eval", "--model", "no-such-model", "--attention", "dense", "--attention-opt", "budget=0.1"],
     "sparse --attention"),
    (["frobnicate"], "invalid choice"),
    (["train"], "required: {dflash,finetune,eda}"),  # the choices, not the parser's internal name
    (["models", "bogus"], "argument {install}: invalid choice: 'bogus'"),
])
def test_invalid_options(capsys, argv, needle):
    assert_clear_error(*run_main(capsys, *argv)[::2], needle)


def test_out_of_device_memory_is_one_line(capsys, monkeypatch):
    """A command that runs out of GPU memory (a batch or context too large for the card) ends with one line."""
    import torch

    import sparsespec.cli as cli

    def exhausted(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1022.00 MiB.\nSee documentation")

    monkeypatch.setattr(cli, "cmd_models", exhausted)
    assert_clear_error(*run_main(capsys, "models")[::2], "out of device memory", "1022.00 MiB")


def test_missing_weight_file(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    (folder / "model.safetensors").unlink()
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2], "no safetensors")


def test_truncated_safetensors(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2], "truncated")


def test_unsupported_architecture(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2],
                       "unsupported architecture", "gpt2")


@pytest.mark.parametrize("name,text,needle", [
    ("config.json", "[1, 2]", "invalid config.json"),  # JSON, but no config
    ("config.json", None, "invalid config.json"),  # a number given as a string (hidden_size "big")
    ("model.safetensors.index.json", "{not json", "invalid model.safetensors.index.json"),
    ("model.safetensors.index.json", '{"weight_map": [1]}', "invalid model.safetensors.index.json"),
])
def test_a_damaged_config_or_index_is_one_line(capsys, tiny_folder, tmp_path, name, text, needle):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    if text is None:
        cfg = json.loads((folder / "config.json").read_text())
        text = json.dumps(cfg | {"hidden_size": "big"})
    (folder / name).write_text(text)
    assert_clear_error(*run_main(capsys, "generate", "--model", str(folder), "--prompt", "x")[::2], needle)


@pytest.mark.parametrize("argv", [
    ["--attention", "topk", "--attention-opt", "budget=0.1", "budget=0.2"],
    ["--attention", "topk:budget=0.1", "--attention-opt", "budget=0.2"],
    ["--attention", "topk:budget=0.1,budget=0.2"],
])
def test_an_attention_option_given_twice_is_refused(capsys, argv):
    assert_clear_error(*run_main(capsys, "generate", "--prompt", "hi", *argv)[::2], "'budget' given twice")


def test_a_drafter_listed_twice_is_refused(capsys):
    assert_clear_error(*run_main(capsys, "bench", "spec", "--target", "no-such-model", "--drafters", "ngram",
                                 "ngram")[::2], "--drafters lists ngram twice")


def test_truncated_gguf(capsys, smollm2_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        bad.write_bytes(src.read(20_000_000))
    assert_clear_error(*run_main(capsys, "generate", "--model", str(bad), "--prompt", "x")[::2], "truncated")


def test_not_a_gguf(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x00" * 1000)
    assert_clear_error(*run_main(capsys, "generate", "--model", str(bad), "--prompt", "x")[::2], "not a GGUF")


def test_gguf_package_missing(capsys, tmp_path, monkeypatch):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\x00" * 1000)
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    assert_clear_error(*run_main(capsys, "generate", "--model", str(model), "--prompt", "x")[::2],
                       "needs the gguf package")


@pytest.mark.slow
def test_prompt_longer_than_context(capsys, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("hello world " * 5000)  # > 8192 tokens
    assert_clear_error(*run_main(capsys, "generate", "--prompt-file", str(prompt))[::2],
                       "exceeds the model's context of 8192")


@pytest.mark.slow
def test_generate_json(capsys):
    code, out, err = run_main(capsys, "generate", "--prompt", "The capital of France is", "--max-new-tokens", "5",
                              "--json")
    assert code == 0, err
    record = json.loads(out)
    assert set(record) == {"token_ids", "text", "prompt_tokens", "ttft_s", "decode_tokens_per_s"}
    assert len(record["token_ids"]) == 5 and record["prompt_tokens"] > 3 and record["ttft_s"] > 0
    assert "Paris" in record["text"]


@pytest.mark.slow
def test_generate_json_of_a_single_token_is_strict_json(capsys):
    """One new token: no decode or verify step, so no rate and no tau: null, not NaN (which JSON does not have),
    plain and speculative."""
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))

    for draft in ([], ["--draft", "ngram"]):
        code, out, err = run_main(capsys, "generate", "--prompt", "Hi", "--max-new-tokens", "1", "--json", *draft)
        assert code == 0, err
        record = strict(out)
        assert record["decode_tokens_per_s"] is None and len(record["token_ids"]) == 1
        assert record.get("tau", None) is None


def test_models_json(capsys):
    code, out, _ = run_main(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["smollm2-135m"]["installed"] and rows["smollm2-135m"]["architecture"] == "llama"
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(rows)


def test_real_process_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "sparsespec", "generate", "--prompt", "x", "--top-p", "7"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_non_finite_budget(capsys):
    assert_clear_error(*run_main(capsys, "generate", "--prompt", "x", "--attention", "topk", "--attention-opt",
                                 "budget=inf")[::2], "budget")


def test_non_utf8_prompt_file(capsys, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    assert_clear_error(*run_main(capsys, "generate", "--prompt-file", str(bad))[::2], "not UTF-8")


def test_unwritable_output_folder_is_refused_before_work(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_clear_error(*run_main(capsys, "fidelity", "--out", str(blocker / "sub"))[::2], "cannot write")
    assert_clear_error(*run_main(capsys, "eval", "--out", str(blocker / "sub"), "--samples", "1", "--tasks",
                                 "niah_single", "--lengths", "512")[::2], "cannot write")


def test_fidelity_refuses_dense(capsys):
    assert_clear_error(*run_main(capsys, "fidelity", "--attention", "dense")[::2], "no key selection")


def test_unknown_task_and_bad_length(capsys):
    assert_clear_error(*run_main(capsys, "eval", "--tasks", "nope")[::2], "unknown task")
    assert_clear_error(*run_main(capsys, "eval", "--lengths", "4q")[::2], "invalid length")


@pytest.fixture
def byte_model(monkeypatch, one_thread):
    """Every model name loads the same tiny byte-level engine (the settings, not the weights, are under test)."""
    from sparsespec.generate import Engine

    from .conftest import byte_engine

    engine = byte_engine()
    monkeypatch.setattr(Engine, "from_name", lambda *args, **kwargs: engine)
    return engine


def test_an_eval_folder_takes_rows_only_from_its_own_settings_and_reports_only_what_was_asked(capsys, tmp_path,
                                                                                               byte_model):
    out = tmp_path / "eval"

    def run(*extra, attention=("dense", "topk")):
        return run_main(capsys, "eval", "--model", "a", "--tasks", "niah_single", "--lengths", "300", "--samples", "1",
                        "--out", str(out), "--attention", *attention, *extra)

    assert run()[0] == 0
    rows = (out / "results.jsonl").read_text()
    for other, setting in ((["--model", "b"], "model"), (["--seed", "1"], "seed"), (["--dtype", "bfloat16"], "dtype"),
                           (["--attention-opt", "budget=0.5"], "policy topk")):
        assert_clear_error(*run(*other)[::2], f"other settings ({setting})", "another --out")
    code, table, _ = run()  # the same settings resume: nothing is recomputed
    assert code == 0 and (out / "results.jsonl").read_text() == rows and "| task | length | dense | topk |" in table
    code, table, _ = run("--perplexity-tokens", "20", attention=("topk:budget=0.5",))  # a policy new to the folder
    assert code == 0 and "dense" not in table and "| task | length | topk:budget=0.5 |" in table
    assert "| perplexity | length | topk:budget=0.5 |" in table
    assert_clear_error(*run("--perplexity-tokens", "30")[::2], "other settings (perplexity)")
    code, table, _ = run(attention=("topk",))
    assert code == 0 and "| task | length | topk |" in table and "perplexity" not in table


def test_eval_report_renders_the_rows_of_a_folder_without_a_model(capsys, tmp_path, byte_model, monkeypatch):
    from sparsespec.generate import Engine

    out = tmp_path / "eval"
    base = ("eval", "--tasks", "niah_single", "--lengths", "300", "--samples", "1", "--out", str(out))
    assert run_main(capsys, *base, "--model", "a", "--attention", "dense", "topk")[0] == 0
    (out / "accuracy.md").unlink()
    monkeypatch.setattr(Engine, "from_name", lambda *a, **k: pytest.fail("--report loaded a model"))
    code, table, _ = run_main(capsys, *base, "--report", "--attention", "topk", "dense", "--device", "cuda")
    assert code == 0 and "| task | length | dense | topk |" in table and (out / "accuracy.md").is_file()
    assert "Accuracy: a (real weights, float32, cpu)" in table  # the recorded model, dtype and device
    assert_clear_error(*run_main(capsys, *base, "--report", "--attention", "topk:budget=0.5")[::2],
                       "holds no results.jsonl rows", "nothing to report")
    assert_clear_error(*run_main(capsys, *base, "--report", "--attention", "topk", "--attention-opt",
                                 "budget=0.5")[::2], "other settings (policy topk)")
    empty = ("eval", "--report", "--out", str(tmp_path / "none"))
    assert_clear_error(*run_main(capsys, *empty)[::2], "holds no results.jsonl rows")


def test_a_bench_folder_takes_rows_only_from_its_own_settings(capsys, tmp_path, byte_model):
    out = tmp_path / "bench"

    def run(*extra, temperatures="0"):
        return run_main(capsys, "bench", "spec", "--target", "a", "--drafters", "ngram", "--prompts", "1", "--kinds",
                        "code", "--max-new-tokens", "6", "--block-size", "3", "--temperatures", temperatures,
                        "--out", str(out), *extra)

    out.mkdir()  # beside an eval's rows made with other settings: each command's rows have their own record
    (out / "results.jsonl").write_text('{"task": "vt"}\n')
    (out / "results.settings.json").write_text('{"seed": 5, "dtype": "bfloat16"}\n')
    assert run()[0] == 0 and len((out / "spec.jsonl").read_text().splitlines()) == 1
    for other, setting in ((["--target", "b"], "target"), (["--max-new-tokens", "7"], "max_new_tokens")):
        assert_clear_error(*run(*other)[::2], f"other settings ({setting})", "another --out")
    code, table, _ = run(temperatures="0,1")  # adds the T = 1 rows
    assert code == 0 and len((out / "spec.jsonl").read_text().splitlines()) == 2 and "| ngram | code (1) | 1 |" in table
    code, table, _ = run(temperatures="1")
    assert code == 0 and "| ngram | code (1) | 1 |" in table and "| 0 |" not in table


def test_a_policy_with_no_sparse_layer_is_refused_by_fidelity_and_said_by_eval(capsys, tmp_path, byte_model):
    """dense_layers covering every layer leaves a policy dense everywhere: fidelity has nothing to compare (it divided
    by zero), eval and generate run it but say so."""
    code, _, err = run_main(capsys, "fidelity", "--model", "a", "--length", "128", "--steps", "1", "--contexts",
                            "natural", "--budgets", "0.1", "--attention", "topk", "--out", str(tmp_path / "f"))
    assert_clear_error(code, err, "every layer of this 2-layer model decodes densely")
    code, _, err = run_main(capsys, "eval", "--model", "a", "--tasks", "niah_single", "--lengths", "300", "--samples",
                            "1", "--attention", "topk", "--out", str(tmp_path / "e"))
    assert code == 0 and "warning: topk: every layer of this 2-layer model decodes densely" in err


def test_reports_say_random_weights_for_a_random_model(capsys, tmp_path, byte_model):
    code, table, _ = run_main(capsys, "bench", "spec", "--target", "random:tiny", "--drafters", "ngram", "--prompts",
                              "1", "--kinds", "code", "--max-new-tokens", "4", "--temperatures", "0")
    assert code == 0 and "random weights" in table and "real weights" not in table


def test_bench_spec_defaults_to_prompt_lookup_alone_without_a_shipped_drafter(capsys, byte_model, monkeypatch,
                                                                              tmp_path):
    """The default target has no shipped DFlash drafter: the default drafters are then prompt lookup alone, said on
    stderr (the default run used to fail after loading the model); a target with one gets both; a --target-name
    without one is an error, as it was."""
    import sparsespec.spec.bench as bench
    import sparsespec.spec.registry as shipped

    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda engine, drafters, *a, **k: seen.update(drafters) or [])
    monkeypatch.setattr(bench, "report", lambda *a, **k: "")
    monkeypatch.setattr(bench, "make_drafter", lambda d, *a, **k: d.text)  # (a stub file: not loaded)
    monkeypatch.setattr(shipped, "DRAFTER_DIR", tmp_path)
    (tmp_path / "qwen2.5-coder-0.5b-dflash.safetensors").write_bytes(b"")
    code, _, err = run_main(capsys, "bench", "spec", "--prompts", "1")
    assert code == 0 and list(seen) == ["ngram"] and "measuring prompt lookup (ngram) alone" in err
    seen.clear()
    assert run_main(capsys, "bench", "spec", "--target", "qwen2.5-coder-0.5b", "--prompts", "1")[0] == 0
    assert list(seen) == ["ngram", "dflash"]
    assert_clear_error(*run_main(capsys, "bench", "spec", "--target", "x.gguf", "--target-name", "smollm2-135m",
                                 "--prompts", "1")[::2], "no DFlash drafter is shipped for 'smollm2-135m'")


def test_a_block_beyond_the_context_and_a_one_token_rate_are_said_plainly(capsys, byte_model):
    code, _, err = run_main(capsys, "generate", "--prompt", "hi", "--draft", "ngram", "--block-size", "100000")
    assert_clear_error(code, err, "beyond the model's context")
    code, _, err = run_main(capsys, "generate", "--prompt", "hi", "--max-new-tokens", "1")
    assert code == 0 and "decode - tok/s" in err


@pytest.mark.parametrize("what", ["attention", "decode"])
def test_bench_sparse_refuses_an_unknown_shape(capsys, what):
    assert_clear_error(*run_main(capsys, "bench", what, "--shape", "llama-9000b")[::2], "unknown model shape",
                       "qwen2.5-coder-1.5b")


@pytest.mark.parametrize("argv,needle", [
    (["bench", "spec", "--target", "no-such-model"], "not found"),  # as the README's 1.5B when it is not installed
    (["eval", "--model", "no-such-model"], "not found"),
    (["eval", "--model", "no-such-model", "--perplexity-tokens", "5000", "--lengths", "2k"], "perplexity tokens"),
])
def test_a_refused_run_leaves_no_output_folder(capsys, tmp_path, argv, needle):
    assert_clear_error(*run_main(capsys, *argv, "--out", str(tmp_path / "out"))[::2], needle)
    assert not (tmp_path / "out").exists()


def test_no_arguments_lists_the_commands_and_version(capsys):
    from importlib.metadata import version

    for argv, needles in (([], ("generate", "policies", "train", "--version")),
                          (["--version"], (version("sparsespec"),))):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        out = capsys.readouterr().out
        assert exit_.value.code in (0, None) and all(n in out for n in needles), out


def test_policies_describe_every_option(capsys):
    code, out, _ = run_main(capsys, "policies", "--json")
    rows = json.loads(out)
    assert code == 0 and rows["dense"] == {} and rows["binarypc"]["bits"]["default"] == 64
    assert all(o["help"] for options in rows.values() for o in options.values())
    text = run_main(capsys, "policies")[1]
    assert all(o["help"] in text for o in rows["doublep"].values())


def test_train_dflash_help_describes_every_option(capsys):
    import argparse

    from sparsespec.cli import build_parser

    def sub(parser, name):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]

    assert all(action.help for action in sub(sub(build_parser(), "train"), "dflash")._actions)
    with pytest.raises(SystemExit):
        main(["train", "dflash", "--help"])
    assert "optimisation steps (default: 2000)" in " ".join(capsys.readouterr().out.split())


class _Writes(io.StringIO):
    """A stdout that keeps each write."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_generate_streams_its_text(capsys, monkeypatch, byte_model):
    argv = ["generate", "--prompt", "Grüße aus Köln 🎉", "--max-new-tokens", "40", "--temperature", "1", "--seed", "1"]
    text = json.loads(run_main(capsys, *argv, "--json")[1])["text"]
    stdout = _Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(argv) == 0
    assert stdout.getvalue() == text + "\n" and len(stdout.writes) > 5


def test_prompts_file_is_one_batch(capsys, tmp_path, byte_model):
    prompts = ["Grüße aus Köln", "日本の首都は", "plain text"]
    (tmp_path / "p.txt").write_text(f"{prompts[0]}\n{prompts[1]}\n\n{prompts[2]}\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    argv = ("generate", "--max-new-tokens", "5", "--prompts-file")
    records = [json.loads(line) for line in run_main(capsys, *argv, str(tmp_path / "p.txt"), "--json")[1].splitlines()]
    assert [r["prompt_tokens"] for r in records] == [len(p.encode()) for p in prompts]  # a byte per token
    assert all(len(r["token_ids"]) == 5 for r in records)
    lines = run_main(capsys, *argv, str(tmp_path / "p.jsonl"), "--json")[1].splitlines()
    assert [json.loads(line)["token_ids"] for line in lines] == [r["token_ids"] for r in records]
    code, out, err = run_main(capsys, *argv, str(tmp_path / "p.txt"))
    assert code == 0 and out == "".join(r["text"] + "\n" for r in records) and "[3 prompts, " in err
    # speculative decoding takes the prompts as one batch too, each row as plain greedy decoding gives it
    lines = run_main(capsys, *argv, str(tmp_path / "p.txt"), "--json", "--draft", "ngram")[1].splitlines()
    assert [json.loads(line)["token_ids"] for line in lines] == [r["token_ids"] for r in records]


@pytest.mark.parametrize("draft", [(), ("--draft", "ngram")])
def test_a_prompt_of_several_that_does_not_fit_is_named(capsys, tmp_path, byte_model, draft):
    limit = byte_model.config.max_position
    (tmp_path / "p.txt").write_text(f"short\n{'x' * limit}\n")
    assert_clear_error(*run_main(capsys, "generate", "--max-new-tokens", "4", "--prompts-file",
                                 str(tmp_path / "p.txt"), *draft)[::2], f"prompt 2 of 2: prompt of {limit} tokens")


def test_an_empty_prompt_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    from sparsespec.generate import Engine

    monkeypatch.setattr(Engine, "from_name", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n{"prompt": ""}\n')
    assert_clear_error(*run_main(capsys, "generate", "--prompt", "")[::2], "the prompt is empty")
    assert_clear_error(*run_main(capsys, "generate", "--prompts-file", str(tmp_path / "p.jsonl"))[::2],
                       "prompt 2 of 2 is empty")


def test_random_weight_models_in_real_shapes(capsys):
    """`--model random:SHAPE`: a model of that shape with random weights (speed measurements), bytes as tokens."""
    code, out, _ = run_main(capsys, "generate", "--model", "random:tiny", "--prompt", "héllo", "--max-new-tokens",
                            "5", "--json")
    record = json.loads(out)
    assert code == 0 and record["prompt_tokens"] == len("héllo".encode()) and len(record["token_ids"]) == 5
    assert max(record["token_ids"]) < 512  # the shape's vocabulary
    assert_clear_error(*run_main(capsys, "generate", "--model", "random:nope", "--prompt", "x")[::2],
                       "unknown model shape 'nope'")


def test_bad_prompts_files(capsys, tmp_path):
    for name, content, needle in (("empty.txt", "\n \n", "no prompts"), ("num.jsonl", '{"prompt": 3}\n', "line 1"),
                                  ("bad.jsonl", '{"prompt": "a"}\n[1]\n', "line 2")):
        (tmp_path / name).write_text(content)
        assert_clear_error(*run_main(capsys, "generate", "--prompts-file", str(tmp_path / name))[::2], needle)


def test_stop_token_ids_and_ignore_eos(capsys, monkeypatch, byte_model):
    argv = ("generate", "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json")
    free = json.loads(run_main(capsys, *argv)[1])["token_ids"]
    stop = free[3]
    cut = free.index(stop)
    unused = next(t for t in range(256) if t not in free)
    stopped = json.loads(run_main(capsys, *argv, "--stop-token-ids", f"{unused},{stop}")[1])
    assert stopped["token_ids"] == free[: cut + 1]  # the stop token is kept in the ids, left out of the text
    assert stopped["text"] == byte_model.tokenizer.decode(free[:cut])
    assert_clear_error(*run_main(capsys, *argv, "--stop-token-ids", "256")[::2], "stop token ids")
    monkeypatch.setattr(byte_model, "eos_ids", frozenset({stop}))
    assert json.loads(run_main(capsys, *argv)[1])["token_ids"] == free[: cut + 1]
    assert json.loads(run_main(capsys, *argv, "--ignore-eos")[1])["token_ids"] == free


def test_progress_lines_when_stderr_is_not_a_terminal(capsys, byte_model):
    argv = ("generate", "--prompt", "hello " * 40, "--prefill-chunk", "64", "--max-new-tokens", "3", "--json")
    assert "prefill" not in run_main(capsys, *argv)[2]
    code, _, err = run_main(capsys, *argv, "--progress")
    assert code == 0 and "prefill: 4/4 (" in err and "decode: " in err


def test_sparse_attention_shows_tokens_attended_and_warns_when_few(capsys, byte_model):
    # the default token floor (min_tokens=1024) attends every key of so short a prompt: no warning
    err = run_main(capsys, "generate", "--prompt", "x" * 100, "--max-new-tokens", "3", "--attention", "topk",
                   "--attention-opt", "dense_layers=0")[2]
    assert "warning" not in err and "101.5 tokens attended per step]" in err
    argv = ("generate", "--prompt", "x" * 100, "--max-new-tokens", "3", "--attention", "topk", "--attention-opt",
            "dense_layers=0", "min_tokens=0", "sinks=0", "window=0")
    err = run_main(capsys, *argv)[2].strip().splitlines()
    assert "2.0 tokens attended per step]" in err[0]
    assert len(err) == 2 and err[1].startswith("sparsespec: warning: topk attended only 2.0 tokens per step")
    err = run_main(capsys, *argv, "budget=1.0")[2].strip().splitlines()
    assert len(err) == 1 and "101.5 tokens attended per step]" in err[0]  # every key (contexts 101, 102): no warning
    assert "attended" not in run_main(capsys, "generate", "--prompt", "x" * 100, "--max-new-tokens", "3")[2]


def test_more_dense_layers_than_the_model_has_are_refused(capsys, byte_model):
    argv = ("generate", "--prompt", "x" * 20, "--max-new-tokens", "2", "--attention")
    assert run_main(capsys, *argv, "topk:dense_layers=2")[0] == 0  # every layer of the 2 dense
    assert_clear_error(*run_main(capsys, *argv, "topk:dense_layers=3")[::2], "dense_layers must be <= the model's 2 "
                       "layers, got 3")


def test_a_folder_of_rows_without_recorded_settings_is_refused(capsys, tmp_path):
    (tmp_path / "results.jsonl").write_text('{"task": "vt"}\n')  # made before folders recorded their settings
    assert_clear_error(*run_main(capsys, "eval", "--out", str(tmp_path))[::2], "without a record", "another --out")


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "no-such-model", "--prompt", "hi", "--row-invariant"],  # on cpu
    ["generate", "--model", "no-such-model", "--prompt", "hi", "--row-invariant", "--device", "cuda",
     "--dtype", "float32"],
    ["bench", "spec", "--target", "no-such-model", "--row-invariant"],
])
def test_row_invariant_products_are_refused_where_they_do_not_run(capsys, argv):
    assert_clear_error(*run_main(capsys, *argv)[::2], "--row-invariant runs on cuda in bfloat16 or float16")


def test_a_closed_pipe_ends_a_command_quietly(monkeypatch, capsys, tmp_path):
    """`sparsespec policies | head -1`: the reader goes away mid-output; no traceback, a clean exit."""
    sink = open(tmp_path / "out", "w")

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return sink.fileno()

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["policies"]) == 0
    assert capsys.readouterr().err == ""
    sink.close()


@pytest.mark.parametrize("where", ["port in use", "not this machine"])
def test_serve_refuses_an_address_it_cannot_listen_on_in_one_line_before_loading(capsys, where):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        host = "127.0.0.1" if where == "port in use" else "192.0.2.1"  # (TEST-NET-1: no interface has it)
        assert main(["serve", "--model", "no-such-model", "--host", host, "--port", str(port)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on {host}:{port}" in err[0], err  # (the model was never looked up)


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "no-such-model", "--prompt", "x", "--draft", "eagle"],
    ["serve", "--model", "no-such-model", "--draft", "tree15:tree3:dflash"],
    ["bench", "spec", "--target", "no-such-model", "--drafters", "ngram", "treex:dflash"],
    ["bench", "spec", "--target", "no-such-model", "--drafters", "none"],
])
def test_a_bad_drafter_is_refused_before_the_model_loads(capsys, argv):
    """The drafter's syntax needs no model: its error comes first (not the model's, nor after a long load)."""
    code, _, err = run_main(capsys, *argv)
    assert_clear_error(code, err)
    assert "not found" not in err and ("drafter" in err or "tree" in err), err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "no-such-model", "--prompt", "x", "--temperature", "inf"], "temperature"),
    (["bench", "spec", "--target", "no-such-model", "--temperatures", "0,inf"], "temperature"),
    (["generate", "--model", "no-such-model", "--prompt", "x", "--draft", "ngram", "--block-size", "1"],
     "--block-size must be >= 2"),
    (["calibrate", "binarypc", "--model", "no-such-model", "--bits", "2000", "--out", "x.safetensors"], "bits"),
    (["eval", "--model", "no-such-model", "--attention", "topk", "--attention-opt", "topkk.budget=0.5"], "'topkk'"),
    (["fidelity", "--model", "no-such-model", "--attention", "topk", "--attention-opt", "quest.sinks=4"],
     "'quest'"),
])
def test_invalid_settings_are_refused_before_the_model_loads(capsys, argv, needle):
    code, _, err = run_main(capsys, *argv)
    assert_clear_error(code, err, needle)


def test_calibrate_refuses_a_folder_for_its_file_before_the_model_loads(capsys, tmp_path):
    assert_clear_error(*run_main(capsys, "calibrate", "binarypc", "--model", "no-such-model", "--out",
                                 str(tmp_path))[::2], "is a folder")


def test_calibrate_names_a_token_count_beyond_the_context(capsys, tmp_path, byte_model):
    too_many = str(byte_model.config.max_position + 1)
    assert_clear_error(*run_main(capsys, "calibrate", "binarypc", "--model", "a", "--tokens", too_many, "--out",
                                 str(tmp_path / "c.safetensors"))[::2], f"--tokens {too_many} is beyond")


@pytest.mark.parametrize("command", ["eval", "longgen"])
def test_dense_layers_beyond_the_model_are_refused_before_the_dense_rows(capsys, tmp_path, byte_model, command):
    out = tmp_path / command
    extra = (["--tasks", "niah_single", "--lengths", "300", "--samples", "1"] if command == "eval" else
             ["--prompts", "1", "--max-new-tokens", "8", "--long-chars", "1000", "--kinds", "long-text"])
    code, _, err = run_main(capsys, command, "--model", "a", "--out", str(out), "--attention", "dense",
                            "topk:dense_layers=99", *extra)
    assert_clear_error(code, err, "dense_layers must be <=")
    assert not list(out.glob("*.jsonl")) if out.exists() else True  # no dense row written first


def test_host_out_of_memory_is_one_line(capsys, monkeypatch):
    import sparsespec.cli as cli

    def fail(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 629145600000 bytes.")

    monkeypatch.setattr(cli, "cmd_policies", fail)
    assert_clear_error(*run_main(capsys, "policies")[::2], "out of host memory")


@pytest.mark.parametrize("command", ["eval", "fidelity", "longgen"])
def test_a_policy_listed_twice_is_refused(capsys, command):
    assert_clear_error(*run_main(capsys, command, "--model", "no-such-model", "--attention", "topk", "quest",
                                 "topk")[::2], "listed twice")


def test_the_cli_module_imports_without_torch():
    """Importing the package and its CLI leaves torch for the command's own work, inside `main`'s handling: a Ctrl-C
    while torch loads (the first seconds of every command) ends with one line, not a traceback from the import."""
    code = "import sys, sparsespec, sparsespec.cli; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
