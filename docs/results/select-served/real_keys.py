"""The BinaryPC keys of a real model's fixed-width decode steps, for the torch emulations beside this file:
qwen2.5-coder-0.5b on CPU (fp32), `binarypc:budget=0.02,sinks=4,window=64`, a held-out long-code prompt of `chars`
characters, `steps` greedy steps; every sparse layer's select as the policy asks for it."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from sparsespec.attention import make_policy, parse_spec  # noqa: E402
from sparsespec.generate import Engine  # noqa: E402
from sparsespec.runner import Runner  # noqa: E402
from sparsespec.spec.prompts import make_prompts  # noqa: E402


@torch.inference_mode()
def select_calls(chars: int, steps: int) -> tuple[int, list[tuple]]:
    """-> (prompt tokens, [(layer, keys [R, S], positions [B], tokens [B], forced_from [B], K, key_bits, extra,
    extra_n)] in step, then layer order)."""
    engine = Engine.from_name("qwen2.5-coder-0.5b", device="cpu", dtype="float32")
    ids = engine.encode(make_prompts(1, "heldout", ("long-code",), 0, chars)[0].text, chat=True)
    name, opts = parse_spec("binarypc:budget=0.02,sinks=4,window=64")
    policy = make_policy(name, opts)
    runner = Runner(engine.model, 1, len(ids) + steps + 1, policy, fixed=True)
    calls = []
    keys_of = policy.fixed_keys

    def kept(layer, q, cache):
        sk = keys_of(layer, q, cache)
        plan = policy.fixed
        ff = plan.positions + 1 if sk.forced_from is None else sk.forced_from
        calls.append((layer, sk.keys.clone(), plan.positions.clone(), plan.tokens.clone(), ff.clone(),
                      plan.buffers(layer)[0].shape[1], sk.key_bits, None if sk.extra is None else sk.extra.clone(),
                      None if sk.extra_n is None else sk.extra_n.clone()))
        return sk

    policy.fixed_keys = kept
    token = engine.model.logits(runner.prefill([ids])).argmax(-1)
    for _ in range(steps):
        token = runner.decode(token).argmax(-1)
    return len(ids), calls
