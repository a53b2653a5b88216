"""``kvgrid demo-model`` and ``kvgrid generate``: the demo model, and offline generation on one engine."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


DEMO_PREFIX = (
    "You are the support assistant of a company that rents out bicycles in a small harbour town. "
    "Answer briefly and politely. The shop opens at nine in the morning and closes at six in the evening, "
    "every day except on public holidays. A city bike costs twelve euros a day, an electric bike thirty, "
    "and a cargo bike forty. Helmets and locks are included; child seats cost three euros extra. "
    "Customers must show an identity document and leave a deposit of fifty euros per bike, returned in full "
    "when the bike comes back undamaged. Bikes returned more than an hour late are charged half a day extra. "
    "Flat tyres are repaired for free; other damage is charged at cost. The shop also sells maps of the "
    "coastal routes, sells water and snacks, and can recommend guided tours on weekends. "
)
DEMO_QUESTIONS = ("How much is an electric bike for two days?", "Do I need to bring my own helmet?")


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from worker.models.demo_model import write_demo_model

    path = write_demo_model(args.dir, args.variant, args.seed, progress=True)
    print(f"wrote the {args.variant} demo model to {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=args.model, block_size=args.block_size, device=args.device))
    tok = engine.tokenizer
    prompts = args.prompt or [DEMO_PREFIX + q for q in DEMO_QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    print(f"model {engine.model_path} on {engine.device}, block size {engine.config.block_size}")
    # Warm up the kernels with a one-token prompt (no full block, so nothing enters the cache).
    engine.generate([[0]], SamplingParams(max_tokens=1))
    # One after the other, so that the second prompt can reuse the first one's shared prefix.
    for i, text in enumerate(prompts, 1):
        ids = tok.encode(text)
        start = time.perf_counter()
        out = engine.generate([ids], params, tenant=args.tenant)[0]
        total = time.perf_counter() - start
        print(f"\n[{i}] prompt: {len(ids)} tokens, {out.num_cached_tokens} from the prefix cache")
        if out.error is not None:  # the engine failed this request alone: maybe before its first token
            print(f"    failed: {out.error}")
        ttft = "none" if out.ttft is None else f"{out.ttft * 1e3:.1f} ms"
        print(f"    time to first token: {ttft}, total {total * 1e3:.1f} ms")
        print(f"    output tokens: {out.token_ids}")
        print(f"    output text:   {out.text!r}")
    return 0


def add_demo_model(sub) -> None:
    d = sub.add_parser("demo-model", help="write the deterministic demo model (HF format) into DIR")
    d.add_argument("dir")
    d.add_argument("--variant", default="llama", choices=["llama", "qwen2"])
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_cmd_demo_model)


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="run prompts through one engine offline and show prefix-cache reuse")
    g.add_argument("--model", default="demo", help="HF model folder, or 'demo' (built on first use)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: two sharing a long prefix")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--tenant", default="default")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--device", default="auto")
    g.set_defaults(func=_cmd_generate)
