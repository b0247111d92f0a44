"""How far placement alone can lower the late-turn first-delta p50: a replay of measured turns.

The project's TTFT is the first content or tool-call *delta*. A tool-call answer's first delta waits, after
its first token, for the parser to release the function name (hermes: ~11 decode steps; glm47, the format the
simulator writes GLM-5's calls in: ~4), and no placement removes that. This takes one policy's
measured late turns (default ``reference``) from ``placement_policies.py --json`` output and replaces the
first token of a share of the short-suffix turns by a decode-local one
(``--local-first-token-s``, measured in the same benchmark's engine trace), keeping each turn's own
hold-back (its first delta less its first chunk). It prints the p50 that results for each share: the share
of short turns that would have to run decode-local to reach a target ratio.

    .venv/bin/python benchmarks/placement_policies.py --policies reference,auto --json > out.txt
    tail -1 out.txt > turns.json
    .venv/bin/python benchmarks/first_delta_bound.py turns.json [--policy reference] [--local-first-token-s 0.097]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

# Run as a script, benchmarks/ is on sys.path: the long/short split of placement_policies.py's leg table.
from placement_policies import LONG_SUFFIX_TOKENS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("turns_json", help="the last line of placement_policies.py --json (policy → turns)")
    ap.add_argument("--policy", default="reference")
    ap.add_argument("--output", type=int, default=128, help="answer tokens per turn of the run")
    ap.add_argument("--local-first-token-s", type=float, default=0.097)
    ap.add_argument("--target", type=float, default=1.5)
    ap.add_argument("--draws", type=int, default=201)
    args = ap.parse_args()
    with open(args.turns_json) as f:
        turns = json.load(f)[args.policy]
    prompt = {(t["repeat"], t["session"], t["turn"]): t["prompt_tokens"] for t in turns}
    late = []  # (short suffix, measured first delta, hold-back)
    for t in turns:
        before = prompt.get((t["repeat"], t["session"], t["turn"] - 1))
        if t["turn"] < 10 or before is None:
            continue
        short = t["prompt_tokens"] - before - args.output <= LONG_SUFFIX_TOKENS
        late.append((short, t["ttft_s"], max(0.0, t["ttft_s"] - t["ttfc_s"])))
    measured = statistics.median(x for _, x, _ in late)
    content = sum(1 for *_, hold in late if hold < 0.005)
    print(f"{args.policy}: {len(late)} late turns, {sum(s for s, *_ in late)} with a short suffix, {content} answer "
          f"with content (no hold-back); first-delta p50 {measured:.3f} s, target {measured / args.target:.3f} s")
    for share in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        p50s = []
        for draw in range(args.draws):
            rng = random.Random(draw)
            p50s.append(statistics.median(
                args.local_first_token_s + hold if short and rng.random() < share else ttft
                for short, ttft, hold in late))
        p50 = statistics.median(p50s)
        print(f"  {share:4.0%} of short turns decode-local: p50 {p50:.3f} s ({measured / p50:.2f}× below)")


if __name__ == "__main__":
    main()
