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
  the block's forward; with remat="mixer" less the mixer's core, which it keeps: FRAC's scan,
  or attention's heads' outputs from q, k, v, "lmstep/attention_core", profiled with its
  heads in pieces like FRAC's scan). Cross-half fusion is lost (a residual add). The
  embedding lookup and its gradient are left out (libtpu's profiler rejects the gather; a
  [tokens, d] read and scatter-add, small beside the head's matmuls). A FRAC mixer's forward is three programs
  (libtpu's profiler fails the whole half, and runs out of this machine's memory on the scan
  kernel at a layer's shape): the half up to its scan ("lmstep/mixer_pre"), the scan op
  ("frac/kernel" at the layer's shape, its heads in pieces of at most 4 profiled once and
  counted per piece: the kernel's cost is linear in heads) and the half from the scan's
  output ("lmstep/mixer_out"). Each part is checked against its FLOP floor (its model
  FLOPs at the MXU peak): an estimate below it is reported as untrusted.
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
import functools
import json
import math
import pathlib
import sys

from benchmarks.aot import perf

HERE = pathlib.Path(__file__).parent
PARTS_LOG = HERE / "step_parts.jsonl"
ICI_BYTES_PER_S = {"tpu-v5e": 1600e9 / 8, "tpu-v6e": 3584e9 / 8}
ADAMW_BYTES_PER_PARAM = 28


def model_facts(spec: dict) -> dict:
  """Parameters, depth, heads and remat policy ("none", "full" or "mixer") of the model `spec`
  describes (an abstract build: no arrays, once per model), and for a FRAC mixer its scan's
  shape per sequence (FRAC's keys: h, p, n, m)."""
  return dict(_model_facts(spec["config"],
                           *(spec.get(k) for k in ("mixer", "ffn", "context", "remat"))))


@functools.lru_cache(maxsize=None)
def _model_facts(config: str, *overrides) -> dict:
  import jax
  from flax import nnx

  from neurips26_jax import configs
  from neurips26_jax.models import LanguageModel
  kwargs = dict(configs.load(config).model.to_dict())
  kwargs.update({k: v for k, v in zip(("mixer", "ffn", "context", "remat"), overrides) if v})
  model = nnx.eval_shape(lambda: LanguageModel(**kwargs, rngs=nnx.Rngs(0)))
  params = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  facts = dict(params=params, layers=kwargs["num_layers"], context=kwargs["context"],
               heads=kwargs["num_heads"], remat=model.remat)
  if kwargs["mixer"] in SCAN_MIXERS:
    mixer = model.blocks[0].mixer
    facts["scan"] = dict(h=mixer.num_heads, p=mixer.head_dim, n=mixer.state_dim,
                         m=mixer.num_modes)
  return facts


HALVES = ("mixer", "ffn")
PARTS = tuple(f"{half}/{direction}" for half in HALVES for direction in ("fwd", "bwd")) + (
    "head",)
DIRECTION = {part: part.partition("/")[2] or "fwd+bwd" for part in PARTS}
SCAN_MIXERS = ("frac", "mamba2")
SCAN_PARTS = ("mixer/fwd:pre", "mixer/fwd:scan", "mixer/fwd:out")   # a FRAC mixer's forward
HEADS_PER_PIECE = 4
# The part of a mixer's forward that remat="mixer" keeps out of the recomputation
# (`models.lm.REMAT_POLICIES`): FRAC's scan, attention's heads' outputs from q, k, v.
CORE_PART = {"frac": "mixer/fwd:scan", "mamba2": "mixer/fwd:scan",
             "attention": "mixer/fwd:core"}


def _piece(heads: int) -> int:
  """Heads per profiled piece: the largest divisor of `heads` up to HEADS_PER_PIECE."""
  return max(d for d in range(1, HEADS_PER_PIECE + 1) if heads % d == 0)


def part_programs(spec: dict) -> dict:
  """{part: (perf_programs name, direction, overrides, times)}: what to profile for each part
  of the step (`times`: how often a piece counts). spec["whole_block"]: the block as one
  program, forward and VJP under its remat ("lmstep/block"), and the head."""
  if spec.get("whole_block"):
    if (spec["mixer"], spec["ffn"]) != ("attention", "swiglu"):
      raise ValueError("step_estimate: whole_block profiles blocks without a kernel only "
                       "(attention + SwiGLU): libtpu's profiler rejects FlashFFN's and FRAC's")
    return {"block": ("lmstep/block", "fwd+bwd", spec, 1),
            "head": ("lmstep/head", "fwd+bwd", spec, 1)}
  programs = {part: (f"lmstep/{part.partition('/')[0]}", DIRECTION[part], spec, 1)
              for part in PARTS}
  facts = model_facts(spec)
  if spec["mixer"] == "attention" and facts["remat"] == "mixer":
    piece = _piece(facts["heads"])
    programs["mixer/fwd:core"] = ("lmstep/attention_core", "fwd", dict(spec, heads=piece),
                                  facts["heads"] // piece)
  if spec["mixer"] in SCAN_MIXERS:
    del programs["mixer/fwd"]
    scan = facts["scan"]
    piece = _piece(scan["h"])
    shape = dict(scan, b=spec["batch"], l=facts["context"], h=piece)
    programs.update({"mixer/fwd:pre": ("lmstep/mixer_pre", "fwd", spec, 1),
                     "mixer/fwd:scan": ("frac/kernel", "fwd", {"shape": shape},
                                        scan["h"] // piece),
                     "mixer/fwd:out": ("lmstep/mixer_out", "fwd", spec, 1)})
  return programs


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
    seconds[name] = r.get("times", 1) * r["cycles"] / chip.clock_hz
    floor = r.get("times", 1) * r["flops"] / (chip.clock_hz * chip.flops_per_cycle)
    if seconds[name] < floor:
      untrusted.append(f"{name} {seconds[name] * 1e3:.2f} ms < its FLOP floor "
                       f"{floor * 1e3:.2f} ms")
  if "block" in seconds:   # the whole block, its recomputation as libtpu schedules it
    half, block = None, seconds["block"]
  else:
    if "mixer/fwd" not in seconds:
      seconds["mixer/fwd"] = sum(seconds[part] for part in SCAN_PARTS)
    # what the backward runs again: nothing, each half's forward ("full"), or that less the
    # mixer's core ("mixer")
    recompute = {h: 0.0 if facts["remat"] == "none" else seconds[f"{h}/fwd"] for h in HALVES}
    if facts["remat"] == "mixer":
      recompute["mixer"] -= seconds[CORE_PART[spec["mixer"]]]
    half = {h: seconds[f"{h}/fwd"] + recompute[h] + seconds[f"{h}/bwd"] for h in HALVES}
    block = sum(half.values())
  compute = seconds["head"] + facts["layers"] * block
  optimizer = ADAMW_BYTES_PER_PARAM * facts["params"] / chips / chip.hbm_bytes_per_s
  collectives = 3 * 4 * facts["params"] * (chips - 1) / chips / ICI_BYTES_PER_S[target]
  tokens = spec["batch"] * facts["context"]          # per chip per step
  peak = chip.clock_hz * chip.flops_per_cycle
  mfu = lambda step: 6 * facts["params"] * tokens / (peak * step)
  low, high = compute + optimizer, compute + optimizer + collectives
  return dict(spec, remat=facts["remat"], target=target, chips=chips, params=facts["params"],
              block_ms=block * 1e3, **{f"{h}_ms": half[h] * 1e3 for h in HALVES if half},
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
  remat = {"mixer": ", remat mixer", "none": ", no remat"}.get(row.get("remat"), "")
  halves = (f"mixer {row['mixer_ms']:.2f}, FFN {row['ffn_ms']:.2f}" if "mixer_ms" in row
            else "one program")
  return (f"| {row['config']} {row['mixer']} + {row['ffn']}, {row['context']} x "
          f"{row['batch']}/chip{remat} | {row['compute_ms']:.1f} ({row['block_ms']:.2f} / "
          f"block: {halves}; head {row['head_ms']:.1f}) | "
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
  parser.add_argument("--remat", default="", choices=("", "none", "full", "mixer"),
                      help="LanguageModel(remat=...) (default: the config's)")
  parser.add_argument("--whole_block", action="store_true",
                      help="profile each block as one program (fwd + VJP under its remat): "
                           "attention + SwiGLU only")
  parser.add_argument("--target", default="tpu-v5e", choices=sorted(perf.CHIPS))
  parser.add_argument("--chips", type=int, default=16)
  parser.add_argument("--batch_per_chip", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=1800.0)
  parser.add_argument("--max_rss_gb", type=float, default=20.0)
  parser.add_argument("--out", default=str(HERE / "step_estimate.json"),
                      help="results file; rows are added (same model and target replaced)")
  args = parser.parse_args(argv)
  spec = dict(config=args.config, mixer=args.mixer, ffn=args.ffn, batch=args.batch_per_chip,
              context=args.context or None, remat=args.remat or None,
              whole_block=args.whole_block)
  parts = {}
  for part, (program, direction, overrides, times) in part_programs(spec).items():
    parts[part] = dict(perf.run_worker(args.target, program, direction, "bfloat16", overrides,
                                       args.timeout, args.max_rss_gb), times=times)
    with PARTS_LOG.open("a") as log:   # the raw results, a line per part
      log.write(json.dumps(dict(parts[part], part=part, model=spec)) + "\n")
    print(f"  {part}: {parts[part].get('status')} {parts[part].get('cycles', '')} cycles "
          f"({parts[part].get('compile_s', '?')} s, {parts[part].get('peak_rss_gb', '?')} GB)",
          flush=True)
  row = estimate(spec, args.target, args.chips, parts)
  row["context"] = row.get("context") or model_facts(spec)["context"]
  print(HEADER + "\n" + line(row))
  out = pathlib.Path(args.out)
  rows = json.loads(out.read_text()) if out.exists() else []
  key = lambda r: (r["config"], r["mixer"], r["ffn"], r.get("context"), r.get("target"),
                   r.get("chips"), r["batch"], r.get("remat", "full"), bool(r.get("whole_block")))
  rows = [r for r in rows if key(r) != key(row)] + [row]
  out.write_text(json.dumps(rows, indent=1) + "\n")
  return 1 if "error" in row else 0


if __name__ == "__main__":
  sys.exit(main())
