"""A LanguageModel's train step time on a TPU slice, estimated without the chips, as the sum of
single-chip parts (the multi-chip static profile is not trusted: it gave one fusion's cycles
for a whole sharded step, issue 33).

  python -m benchmarks.aot.step_estimate --config=configs/lm_paper.py:125m \\
      --mixer=attention --ffn=swiglu [--target=tpu-v5e --chips=16 --batch_per_chip=1]

The parts of one chip's step (FSDP over every chip, as `configs/lm_paper.py` trains):
- compute: libtpu's static cycle estimate (`perf_worker`) of the chip's share at its batch:
  N x a block plus "lmstep/head" (final norm, LM head and the chunked loss, forward and VJP).
  A block is its two halves, "lmstep/mixer" and "lmstep/ffn" (x + layer(norm(x))), each its
  forward ("fwd") and its VJP from the forward's residuals ("bwd") in programs of their own,
  so no program holds two kernels (libtpu's profiler rejected a FlashFFN block with both):
  per half, fwd + bwd, plus a second fwd under the model's remat (the backward recomputes
  the block's forward). Cross-half fusion is lost (a residual add). The embedding lookup and its
  gradient are left out (libtpu's profiler rejects the gather; a [tokens, d] read and
  scatter-add, small beside the head's matmuls). Each part is checked against its FLOP
  floor (its model FLOPs at the MXU peak): an estimate below it is reported as untrusted.
- optimizer: AdamW over the chip's 1/chips of the parameters at the HBM floor, 28 bytes per
  parameter (read p, g, m, v; write p, m, v).
- collectives, a stated model (not a measurement): every chip receives (chips - 1) / chips
  of the float32 parameters three times per step (gathered for the forward, again for the
  rematerialised forward and backward, and the gradients' reduce-scatter), at the chip's
  ICI bandwidth (v5e 1,600 Gbps, v6e 3,584 Gbps: Google Cloud's per-chip figures), counted
  once per byte received and not overlapped with compute (an upper bound; the lower is 0).
The row: each part in ms, the step with and without the collectives, tokens per second per
chip and MFU = 6 N tokens / (chips x peak x step) (N: all parameters; remat's extra forward
is work the MFU does not count).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from benchmarks.aot import perf

HERE = pathlib.Path(__file__).parent
ICI_BYTES_PER_S = {"tpu-v5e": 1600e9 / 8, "tpu-v6e": 3584e9 / 8}
ADAMW_BYTES_PER_PARAM = 28


def model_facts(spec: dict) -> dict:
  """Parameters and depth of the model `spec` describes (an abstract build: no arrays)."""
  import jax
  from flax import nnx

  from benchmarks.aot.scale import load_config
  from models import LanguageModel
  kwargs = dict(load_config(spec["config"]).model.to_dict())
  kwargs.update({k: spec[k] for k in ("mixer", "ffn", "context") if spec.get(k)})
  model = nnx.eval_shape(lambda: LanguageModel(**kwargs, rngs=nnx.Rngs(0)))
  params = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return dict(params=params, layers=kwargs["num_layers"], context=kwargs["context"],
              remat=bool(kwargs.get("remat")))


HALVES = ("mixer", "ffn")
PARTS = tuple(f"{half}/{direction}" for half in HALVES for direction in ("fwd", "bwd")) + (
    "head",)
DIRECTION = {part: part.partition("/")[2] or "fwd+bwd" for part in PARTS}


def estimate(spec: dict, target: str, chips: int, parts: dict) -> dict:
  """The row for one model from its parts' perf_worker results {part: r} (PARTS)."""
  chip = perf.CHIPS[target]
  facts = model_facts(spec)
  seconds = {}
  untrusted = []
  for name, r in parts.items():
    if r.get("status") != "ok":
      return dict(spec, target=target, chips=chips,
                  error=f"{name}: {r.get('status')}: {r.get('error', '')[:200]}")
    seconds[name] = r["cycles"] / chip.clock_hz
    floor = r["flops"] / (chip.clock_hz * chip.flops_per_cycle)
    if seconds[name] < floor:
      untrusted.append(f"{name} {seconds[name] * 1e3:.2f} ms < its FLOP floor "
                       f"{floor * 1e3:.2f} ms")
  forwards = 2 if facts["remat"] else 1
  half = {h: forwards * seconds[f"{h}/fwd"] + seconds[f"{h}/bwd"] for h in HALVES}
  block = sum(half.values())
  compute = seconds["head"] + facts["layers"] * block
  optimizer = ADAMW_BYTES_PER_PARAM * facts["params"] / chips / chip.hbm_bytes_per_s
  collectives = 3 * 4 * facts["params"] * (chips - 1) / chips / ICI_BYTES_PER_S[target]
  tokens = spec["batch"] * facts["context"]          # per chip per step
  peak = chip.clock_hz * chip.flops_per_cycle
  mfu = lambda step: 6 * facts["params"] * tokens / (peak * step)
  low, high = compute + optimizer, compute + optimizer + collectives
  return dict(spec, target=target, chips=chips, params=facts["params"],
              block_ms=block * 1e3, mixer_ms=half["mixer"] * 1e3, ffn_ms=half["ffn"] * 1e3,
              head_ms=seconds["head"] * 1e3,
              compute_ms=compute * 1e3, optimizer_ms=optimizer * 1e3,
              collectives_ms=collectives * 1e3, step_ms=(low * 1e3, high * 1e3),
              tokens_per_s_per_chip=(tokens / high, tokens / low), mfu=(mfu(high), mfu(low)),
              untrusted=untrusted)


def line(row: dict) -> str:
  if "error" in row:
    return f"| {row['config']} {row['mixer']} + {row['ffn']} | error: {row['error']} |"
  step, tps, mfu = row["step_ms"], row["tokens_per_s_per_chip"], row["mfu"]
  flag = " (untrusted: " + "; ".join(row["untrusted"]) + ")" if row["untrusted"] else ""
  return (f"| {row['config']} {row['mixer']} + {row['ffn']}, {row['context']} x "
          f"{row['batch']}/chip | {row['compute_ms']:.1f} ({row['block_ms']:.2f} / block: mixer "
          f"{row['mixer_ms']:.2f}, FFN {row['ffn_ms']:.2f}; head {row['head_ms']:.1f}) | "
          f"{row['optimizer_ms']:.2f} | {row['collectives_ms']:.1f} | {step[0]:.1f} - "
          f"{step[1]:.1f} | {tps[0]:,.0f} - {tps[1]:,.0f} | {100 * mfu[0]:.0f}% - "
          f"{100 * mfu[1]:.0f}%{flag} |")


HEADER = ("| model, context x sequences per chip | compute ms (per block) | AdamW ms | "
          "collectives ms (model) | step ms | tokens/s/chip | MFU |\n|---|---|---|---|---|---|---|")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/lm_paper.py:125m")
  parser.add_argument("--mixer", default="attention")
  parser.add_argument("--ffn", default="swiglu")
  parser.add_argument("--context", type=int, default=0, help="(default: the config's)")
  parser.add_argument("--target", default="tpu-v5e", choices=sorted(perf.CHIPS))
  parser.add_argument("--chips", type=int, default=16)
  parser.add_argument("--batch_per_chip", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=1800.0)
  parser.add_argument("--max_rss_gb", type=float, default=20.0)
  parser.add_argument("--out", default=str(HERE / "step_estimate.json"),
                      help="results file; rows are added (same model and target replaced)")
  args = parser.parse_args(argv)
  spec = dict(config=args.config, mixer=args.mixer, ffn=args.ffn, batch=args.batch_per_chip,
              context=args.context or None)
  parts = {}
  for part in PARTS:
    parts[part] = perf.run_worker(args.target, f"lmstep/{part.partition('/')[0]}",
                                  DIRECTION[part], "bfloat16", spec, args.timeout,
                                  args.max_rss_gb)
    print(f"  {part}: {parts[part].get('status')} {parts[part].get('cycles', '')} cycles "
          f"({parts[part].get('compile_s', '?')} s, {parts[part].get('peak_rss_gb', '?')} GB)",
          flush=True)
  row = estimate(spec, args.target, args.chips, parts)
  row["context"] = row.get("context") or model_facts(spec)["context"]
  print(HEADER + "\n" + line(row))
  out = pathlib.Path(args.out)
  rows = json.loads(out.read_text()) if out.exists() else []
  key = lambda r: (r["config"], r["mixer"], r["ffn"], r.get("context"), r.get("target"),
                   r.get("chips"), r["batch"])
  rows = [r for r in rows if key(r) != key(row)] + [row]
  out.write_text(json.dumps(rows, indent=1) + "\n")
  return 1 if "error" in row else 0


if __name__ == "__main__":
  sys.exit(main())
