"""The ``generate`` command: prompts in (a JSONL file or ``--prompt`` text), each
request's sampling (the command's options under each line's own keys), one run in
the chosen mode (spec, plain, reference), and the requests out (ids, text, the
sampling each used).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..checkpoint.loader import resolve_checkpoint
from ..checkpoint.tokenizer import CheckpointTokenizer, load_tokenizer
from ..config import RunConfig
from ..errors import InputError, show_value
from ..launch.follower import mirror
from ..launch.ranks import load_on_ranks
from ..parallel.group import TPGroup
from ..runtime.engine import SpecEngine
from ..runtime.generate import plain_generate, reference_generate
from ..runtime.request_checks import RequestLimits, validate_prompts
from ..sampling import (KEYS as SAMPLING_KEYS, SamplingParams, request_seed,
                         sampling_per_prompt)
from .prompts import Prompt, prompt_ids, read_prompts

MODES = {"reference": reference_generate, "plain": plain_generate}  # and "spec"
OFF = asdict(SamplingParams())  # each field's default: off
SAMPLING_OPTIONS = {  # generate's options, by SamplingParams field: (type, help)
    "temperature": (float, "0 (the default) decodes greedily; > 0 samples from the "
                           "target's distribution at this temperature"),
    "top_p": (float, "sample from the smallest set of likeliest tokens holding this "
                     "probability mass, in (0, 1] (default 1: off)"),
    "top_k": (int, "sample from the k likeliest tokens (default 0: off)"),
    "seed": (int, "in [0, 2**63): seeds the run, request i gets its own seed derived from "
                  "it, and the same seed gives the same tokens (default: a fresh random "
                  "seed per request, shown by --json)"),
    "min_p": (float, "sample only tokens of at least this times the likeliest one's "
                     "probability, in [0, 1] (default 0: off)"),
    "presence_penalty": (float, "subtract this from the logit of every token the output "
                                "holds, in [-2, 2] (needs graph.penalties: true)"),
    "frequency_penalty": (float, "subtract this times its count in the output from each "
                                 "token's logit, in [-2, 2] (needs graph.penalties: true)"),
    "repetition_penalty": (float, "divide the positive logits (multiply the negative ones) "
                                  "of tokens in the prompt or output by this, in (0, 100] "
                                  "(default 1: off; needs graph.penalties: true)"),
    "min_tokens": (int, "hold EOS and the stop ids back until this many tokens (needs "
                        "graph.penalties: true)"),
}


def _sampling_option(key: str, kind: type):
    """An argparse type: one ``SamplingParams`` field, checked as the library checks it
    (``--top-p 0`` is refused before any work, naming the range)."""
    option = "--" + key.replace("_", "-")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "a number" if kind is float else "an integer"
            raise argparse.ArgumentTypeError(f"expected {expected}, got "
                                             f"{show_value(text, 40)}") from None
        try:
            checked = SamplingParams(**{key: value}).checked(option)
        except InputError as exc:  # argparse names the option itself
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{option}: ")) from None
        return getattr(checked, key)
    return parse


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """generate's sampling options: defaults for every request of the run."""
    group = parser.add_argument_group(
        "sampling", f"defaults for every request; a --prompts line's own keys "
                    f"({', '.join(SAMPLING_KEYS)}) override them for that request")
    for key, (kind, text) in SAMPLING_OPTIONS.items():  # (logit_bias: in --prompts lines)
        group.add_argument("--" + key.replace("_", "-"), dest=key, default=None,
                           type=_sampling_option(key, kind), help=text)


def run_generate(args: argparse.Namespace, cfg: RunConfig, group: TPGroup) -> int:
    if args.prompts is not None:
        given = read_prompts(args.prompts)
    else:
        given = [Prompt(f"--prompt #{i}", text) for i, text in enumerate(args.prompt, 1)]
    sampling = request_sampling(args, given)
    models, _ = load_on_ranks(cfg, group, progress=sys.stderr.isatty())
    root = resolve_checkpoint(cfg.checkpoint)
    tokenizer = load_tokenizer(root, models.cfg.vocab_size)
    prompts = prompt_ids(given, tokenizer, root)
    if args.mode == "spec":
        # Refuse bad prompts before spending time on capture.
        validate_prompts(prompts, RequestLimits.of(models.cfg, cfg.pool.max_context,
                                                   lookahead=cfg.speculative.num_steps - 1),
                         args.max_new_tokens)
        sampled = [p.where for p, s in zip(given, sampling) if not s.greedy]
        if sampled and not cfg.graph.sampling:
            raise InputError(f"{sampled[0]}: the request samples, but the config sets "
                             f"graph.sampling: false (greedy graphs only)")
        engine = SpecEngine(models.target, models.draft, cfg.speculative, cfg.pool, cfg.graph,
                            progress=sys.stderr.isatty(),  # a capture progress bar
                            scheduler=cfg.scheduler)
        result = engine.generate(prompts, args.max_new_tokens, sampling=sampling)
    else:  # every rank runs the same decoding (its collectives need them all)
        result = mirror(group, models, f"{args.mode}_generate", prompts, args.max_new_tokens,
                        max_context=cfg.pool.max_context, sampling=sampling)
    reqs = [_request(p, ids, out, tokenizer, s)
            for p, ids, out, s in zip(given, prompts, result.outputs, sampling)]
    if args.json:
        print(json.dumps({"requests": reqs, "stats": result.stats}))
    else:
        for i, req in enumerate(reqs):
            text = json.dumps(req["text"], ensure_ascii=False) if "text" in req else None
            print(f"request {i}: {req['output_ids']}" + (f"  text: {text}" if text else ""))
        print(json.dumps(result.stats))
    return 0


def request_sampling(args: argparse.Namespace, given: list[Prompt]) -> list[SamplingParams]:
    """Each request's sampling: the command's options, then its line's own keys over
    them; ``--seed`` seeds the run, request i gets ``request_seed(seed, i)``. Resolved
    here, on rank 0, before any mirrored call: a seed left unset is drawn once, so every
    tensor-parallel rank decodes with the same one."""
    defaults = {k: getattr(args, k) for k in SAMPLING_OPTIONS
                if k != "seed" and getattr(args, k) is not None}
    per = [{**defaults, **({} if args.seed is None else {"seed": request_seed(args.seed, i)}),
            **p.sampling} for i, p in enumerate(given)]
    return sampling_per_prompt(per, len(given))


def _request(prompt: Prompt, ids: list[int], out: list[int],
             tokenizer: CheckpointTokenizer | None, sampling: SamplingParams) -> dict:
    """One request of the output: ids in and out; with a tokenizer, the decoded output
    (``text``) and, for a text prompt, the prompt as given (``prompt_text``); for a
    sampled request, the parameters it used, its seed included (``sampling``)."""
    req: dict = {"input_ids": ids, "output_ids": out}
    if isinstance(prompt.value, str):
        req["prompt_text"] = prompt.value
    if tokenizer is not None:
        req["text"] = tokenizer.decode(out)
    if not sampling.greedy:  # the four always, the other fields where they are not off
        req["sampling"] = {k: v for k, v in asdict(sampling).items() if k != "ban_ids" and (
            k in ("temperature", "top_p", "top_k", "seed") or v != OFF[k])}
    return req
