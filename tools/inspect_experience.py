#!/usr/bin/env python
"""Show one sample of a sealed experience batch in readable form.

    tools/inspect_experience.py DIR [--sample ID | --index N | --list] [--tokenizer TOKDIR]

DIR is a batch written by ``megarl.experience.seal.save_sealed`` (``manifest.json`` +
``experience.safetensors``); it is loaded with ``load_sealed``, which verifies the file and
content hashes, so a corrupted batch is refused (error naming the file, exit status 2).

For one sample (``--sample ID``, else ``--index N``, default 0) it prints the ids, policy
version, finish reason and sampling config, the prompt and response (text when ``--tokenizer``
names the run's tokenizer directory; token ids always), a table with one row per real
response token (position, token id, token text, response_mask, loss_mask, rollout / old /
reference log-probs, value, advantage, return, and is_weight / shaped_reward when present;
columns the batch does not hold are left out), then the reward record and the batch's
content hash.  For a multi-turn trajectory (a record with ``token_origins``) a table of its
turns comes before the per-token table: one row per run of policy or environment tokens, with
the turn, the source, the response positions, the response / loss mask counts, the policy
version(s) and the tokens.  ``--list`` prints one line per sample instead.

``--scorer-input NAME=RM_DIR[:TEMPLATE] --data FILE --tokenizer POLICY_TOKDIR`` renders the
sample again as the neural scorer NAME read it and compares it with the digest its record kept
(``--scorer-prompt T``: a reference-guided model's user turn; default the one RM_DIR records).

``--rederive [KEY=VALUE ...]`` derives the batch's advantages, returns, loss mask and weights
again from its sealed facts (:func:`megarl.algo.derivation.derive`) at the settings its
derived tensors record, with each KEY=VALUE changed (``kl_beta``, ``gamma``, ``lam``,
``whiten``, ``zero_std_rule``, ``std_eps``, ``kl_placement``, ``estimator``), and prints how
far each tensor is from the one the trainer sealed: with no change, 0 (bitwise) is the proof
that the record re-derives what it claims.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.errors import MegarlError, cli_main  # noqa: E402


class InspectError(MegarlError, ValueError):
    pass


# ---- loading -----------------------------------------------------------------------------------


def load_batch(directory: str):
    from megarl.experience.seal import MANIFEST_NAME, CorruptExperienceError, load_sealed

    if not os.path.isdir(directory):
        raise InspectError(f"{directory}: experience directory not found")
    manifest = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        raise InspectError(f"{manifest}: not found (DIR must be a batch written by save_sealed)")
    try:
        return load_sealed(directory)
    except CorruptExperienceError as e:
        # Hash mismatches of the tensor file already name it; a content-hash mismatch names no
        # file (the tensors and the metadata are covered together): point at the manifest.
        msg = str(e)
        where = "" if directory in msg or os.path.abspath(directory) in msg else f"{manifest}: "
        raise InspectError(f"{where}corrupt experience batch: {msg}") from None
    except (OSError, KeyError, TypeError, ValueError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
        raise InspectError(f"{manifest}: cannot load experience batch: {detail}") from None
    except Exception as e:  # safetensors' own error type for an unreadable header
        if type(e).__name__ == "SafetensorError":
            raise InspectError(f"{directory}: cannot read the tensor file: {e}") from None
        raise


def load_tokenizer(path: str):
    if not os.path.isdir(path):
        raise InspectError(f"{path}: tokenizer directory not found")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- any failure here is a bad --tokenizer argument
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InspectError(f"{path}: cannot load a tokenizer: {first}") from None


def select(batch, sample: str | None, index: int | None) -> int:
    ids = batch.facts.sample_id
    bs = len(ids)
    if sample is not None:
        if sample not in ids:
            near = [s for s in ids if sample in s][:5]
            hint = f"; ids containing it: {near}" if near else f"; first ids: {list(ids[:3])}"
            raise InspectError(f"sample {sample!r} is not in this batch ({bs} samples){hint}")
        return ids.index(sample)
    i = 0 if index is None else index
    if not -bs <= i < bs:
        raise InspectError(f"--index {i} out of range: the batch has {bs} samples (0..{bs - 1})")
    return i % bs


# ---- formatting --------------------------------------------------------------------------------


def _q(text: str) -> str:
    """A token's text, quoted with escapes so whitespace and newlines are visible."""
    return json.dumps(text, ensure_ascii=False)


def _num(x: float) -> str:
    return f"{x + 0.0:.4f}"  # + 0.0: no "-0.0000"


def _decode(tok, ids: list[int]) -> str:
    try:
        return tok.decode(ids, skip_special_tokens=False)
    except Exception as e:  # noqa: BLE001 -- ids outside the vocabulary, a foreign tokenizer
        return f"<cannot decode: {e}>"


def _token_text(tok, t: int) -> str:
    if t < 0 or t >= len(tok):
        return "<out of vocab>"
    return _q(_decode(tok, [t]))


def _block(text: str, indent: str = "    | ") -> list[str]:
    return [indent + line for line in (text.split("\n") if text else [""])]


def _table(header: list[str], rows: list[list[str]], left: tuple[str, ...] = ()) -> list[str]:
    """Right-aligned columns, except those named in ``left``."""
    widths = [max(len(h), *(len(r[c]) for r in rows)) if rows else len(h) for c, h in enumerate(header)]
    just = [str.ljust if h in left else str.rjust for h in header]
    fmt = lambda cells: "  " + "  ".join(j(c, w) for c, w, j in zip(cells, widths, just)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _reward_total(r) -> str:
    return "-" if r.total is None else f"{r.total:g}"


def turns_table(batch, i: int, tok=None) -> list[str]:
    """The turns of multi-turn sample ``i``: one row per maximal run of tokens with the same
    turn and source (a policy turn, then the environment output that follows it)."""
    f, d = batch.facts, batch.derived
    o = f.token_origins
    src, turn, versions = o.source[i].tolist(), o.turn[i].tolist(), o.token_versions(i)
    ids, rmask = f.response_ids[i].tolist(), f.response_mask[i].tolist()
    lmask = d.loss_mask[i].tolist() if d is not None else None
    runs: list[list[int]] = []
    for t, s in enumerate(src):
        if s == 0:
            break  # padding only at the end
        if runs and (src[runs[-1][0]], turn[runs[-1][0]]) == (s, turn[t]):
            runs[-1].append(t)
        else:
            runs.append([t])
    header = ["turn", "source", "positions", "tokens", "response_mask"] + (["loss_mask"] if lmask else []) + \
        ["version"] + (["text"] if tok is not None else []) + ["ids"]
    rows = []
    for run in runs:
        n, a, b = len(run), run[0], run[-1]
        vs = sorted({versions[t] for t in run if versions[t] is not None})
        row = [str(turn[a]), "policy" if src[a] == 1 else "environment", f"{a}..{b}", str(n),
               f"{sum(rmask[t] != 0 for t in run)}/{n}"]
        if lmask:
            row.append(f"{sum(lmask[t] != 0 for t in run)}/{n}")
        row.append(",".join(vs) if vs else "-")
        if tok is not None:
            row.append(_q(_decode(tok, [ids[t] for t in run])))
        row.append(str([ids[t] for t in run]))
        rows.append(row)
    n_pol = sum(1 for s in src if s == 1)
    n_env = sum(1 for s in src if s == 2)
    return ["", f"turns: {int(o.num_turns()[i])} policy turns; {n_pol} policy tokens, {n_env} environment tokens "
                f"(loss mask 0); versions in this batch: {', '.join(o.versions) or '-'}"] + \
        _table(header, rows, left=("source", "version", "text", "ids"))


def describe(batch, i: int, directory: str, tok=None) -> list[str]:
    f, d = batch.facts, batch.derived
    P = f.prompt_len
    am = f.attention_mask[i].tolist()
    prompt_real = [p for p in range(P) if am[p]]
    resp_real = [t for t in range(f.response_len) if am[P + t]]
    prompt_ids = [int(f.prompt_ids[i, p]) for p in prompt_real]
    response_ids = f.response_ids[i].tolist()
    rmask = f.response_mask[i].tolist()
    seed = f.seed[i]

    out = [
        f"batch           {directory}",
        f"run_id          {f.run_id}",
        f"iteration       {f.iteration}",
        f"sample          {i} of {f.batch_size}",
        f"sample_id       {f.sample_id[i]}",
        f"prompt_id       {f.prompt_id[i]}",
        f"group_id        {f.group_id[i]}",
        f"request_id      {f.request_id[i]}",
        f"seed            {'-' if seed is None else seed}",
        f"policy_version  {f.policy_version[i]}",
        f"finish_reason   {f.finish_reason[i].value}",
        "sampling        " + " ".join(f"{k}={v}" for k, v in f.sampling.to_json().items()),
    ]
    if d is not None:
        hp = json.dumps(dict(d.hyperparameters), sort_keys=True)
        out.append(f"derived         estimator={d.estimator} hyperparameters={hp}")
    else:
        out.append("derived         (none: no advantages / returns in this batch)")

    out += ["", f"prompt: {len(prompt_ids)} tokens ({P - len(prompt_ids)} left padding)"]
    if tok is not None:
        out += ["  text:"] + _block(_decode(tok, prompt_ids))
    out.append(f"  ids: {prompt_ids}")
    n_actions = sum(1 for t in resp_real if rmask[t])
    out += ["", f"response: {len(resp_real)} tokens, {n_actions} sampled actions "
                f"({f.response_len - len(resp_real)} right padding)"]
    if tok is not None:
        out += ["  text:"] + _block(_decode(tok, [response_ids[t] for t in resp_real]))
    out.append(f"  ids: {[response_ids[t] for t in resp_real]}")
    if f.token_origins is not None:
        out += turns_table(batch, i, tok)

    # Columns: name, header, per-token values (None when the batch does not hold it).
    lps = [("rollout_lp", "rollout", f.rollout_log_probs), ("old_lp", "old", f.old_log_probs),
           ("ref_lp", "ref", f.ref_log_probs)]
    out += ["", "log-prob producers:"]
    for col, label, lp in lps:
        if lp is None:
            out.append(f"  {label:<8}(not recorded)")
        else:
            p = lp.producer
            prec = f" precision={p.precision}" if p.precision else ""
            out.append(f"  {label:<8}role={p.role} version={p.version} space={p.space}{prec}  -> column {col}")
    out.append(f"  {'value':<8}" + (f"critic_version={f.critic_version}" if f.values is not None else "(not recorded)"))
    if f.bootstrap_values is not None:
        out.append(f"  {'V(s_T)':<8}{_num(float(f.bootstrap_values[i]))}  (the bootstrap of a truncated response)")

    header = ["pos", "token"] + (["text"] if tok is not None else []) + ["response_mask"]
    numeric: list[tuple[str, object, bool]] = []  # (header, tensor, is_mask)
    if d is not None:
        numeric.append(("loss_mask", d.loss_mask, True))
    numeric += [(col, lp.values, False) for col, _, lp in lps if lp is not None]
    if f.values is not None:
        numeric.append(("value", f.values, False))
    if d is not None:
        numeric += [(name, t, False) for name, t in (("advantage", d.advantages), ("return", d.returns),
                                                    ("is_weight", d.is_weights), ("shaped_reward", d.shaped_rewards))
                    if t is not None]
    header += [h for h, _, _ in numeric]
    columns = [(t[i].tolist(), is_mask) for _, t, is_mask in numeric]
    rows = []
    for t in resp_real:
        row = [str(t), str(response_ids[t])]
        if tok is not None:
            row.append(_token_text(tok, response_ids[t]))
        row.append(str(rmask[t]))
        for values, is_mask in columns:
            v = values[t]
            row.append(f"{v:g}" if is_mask else _num(v))
        rows.append(row)
    out += ["", "per-token (real response tokens):"] + _table(header, rows, left=("text",))

    r = f.rewards[i]
    comps = ", ".join(f"{k}={v:g}" for k, v in sorted(r.components.items())) or "(none)"
    out += [
        "",
        "reward:",
        f"  total           {_reward_total(r)}",
        f"  status          {r.status.value}",
        f"  error           {r.error if r.error else '-'}",
        f"  components      {comps}",
        f"  scorer_version  {r.scorer_version}",
    ]
    if r.step_rewards is not None:
        steps = ", ".join(f"{s:g}@{e}" for s, e in zip(r.step_rewards, r.step_token_ends))
        out.append(f"  step_rewards    {steps}  (score@last response token of the step)")
    if r.applies_to is not None:
        for x in r.applies_to:
            out.append(f"  applies to      {x.label or 'part'}: {x.value:g} for response tokens {x.first}..{x.last}, "
                       f"received after {x.last}")
        rest = r.outcome_remainder()
        if rest != 0.0:
            out.append(f"  applies to      the whole response: {rest:g}, received after its last action")
    for name, digest in sorted(r.inputs.items()):  # what each neural scorer read (--scorer-input re-renders it)
        out.append(f"  input of {name:<7s}{digest}")
    out += ["", f"content_hash    {batch.content_hash}"]
    return out


def listing(batch, directory: str) -> list[str]:
    f = batch.facts
    P = f.prompt_len
    resp_len = f.attention_mask[:, P:].sum(dim=1).tolist()
    actions = f.response_lengths().tolist()
    rows = []
    for i, sid in enumerate(f.sample_id):
        r = f.rewards[i]
        rows.append([str(i), sid, f.policy_version[i], f.finish_reason[i].value, _reward_total(r),
                     r.status.value, str(int(resp_len[i])), str(int(actions[i]))])
    header = ["index", "sample_id", "version", "finish", "reward", "status", "resp_len", "actions"]
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [
        f"batch {directory}: run_id={f.run_id} iteration={f.iteration} samples={f.batch_size} "
        f"content_hash={batch.content_hash}",
        fmt(header),
    ] + [fmt(r) for r in rows]


_SETTING_TYPES = {"kl_beta": float, "gamma": float, "lam": float, "std_eps": float, "whiten": None,
                  "zero_std_rule": str, "kl_placement": str, "estimator": str}


def parse_overrides(pairs) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in _SETTING_TYPES:
            raise InspectError(f"--rederive {pair!r}: expected KEY=VALUE with KEY one of {sorted(_SETTING_TYPES)}")
        cast = _SETTING_TYPES[key]
        if cast is None:
            if value.lower() not in ("true", "false"):
                raise InspectError(f"--rederive {key}={value}: expected true or false")
            out[key] = value.lower() == "true"
        else:
            try:
                out[key] = cast(value)
            except ValueError:
                raise InspectError(f"--rederive {key}={value}: expected a {cast.__name__}") from None
    return out


def rederive(batch, **overrides):
    """``(settings, derived, metrics)``: the batch's derived tensors computed again from its
    sealed facts at the settings they record, ``overrides`` applied."""
    from megarl.algo.derivation import DerivationSettings, derive

    if batch.derived is None:
        raise InspectError("this batch holds no derived tensors: nothing records the settings to derive under")
    settings = DerivationSettings.from_record(batch.derived, **overrides)
    derived, metrics = derive(batch.facts, settings)
    return settings, derived, metrics


def rederive_report(batch, overrides: dict) -> list[str]:
    import torch

    settings, new, metrics = rederive(batch, **overrides)
    old = batch.derived
    out = [f"re-derived from the sealed facts: estimator={settings.estimator} "
           f"settings={json.dumps(settings.hyperparameters(), sort_keys=True)}",
           f"changed: {json.dumps(overrides, sort_keys=True) if overrides else 'nothing (the recorded settings)'}"]
    for name in ("advantages", "returns", "loss_mask", "is_weights", "shaped_rewards"):
        a, b = getattr(old, name), getattr(new, name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            out.append(f"  {name:<15}{'only re-derived' if a is None else 'only sealed'}")
            continue
        same = torch.equal(a, b)
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        out.append(f"  {name:<15}{'bitwise equal' if same else f'max |sealed - re-derived| {diff:.6g}'}")
    out.append(f"  advantage mean {metrics['prep/advantage_mean']:.6g}, std {metrics['prep/advantage_std']:.6g}")
    return out


def scorer_input_report(batch, i: int, spec: str, data_path: str, policy_tok,
                        scorer_prompt: Optional[str] = None) -> tuple[list[str], bool]:
    """Render sample ``i`` again as the neural scorer ``NAME=DIR[:TEMPLATE]`` read it (its own
    tokenizer and template, the prompt row of ``data_path`` and the response decoded with the
    policy's tokenizer; a reference-guided model's user turn ``scorer_prompt``, by default the one
    its directory records) and compare the digest with the one its record kept: ``(lines, same)``."""
    from megarl.data.tokenizer import TokenizerContract
    from megarl.roles.reward_model import input_digest, recorded_scorer_prompt, render_for_scorer

    if "=" not in spec:
        raise InspectError(f"--scorer-input {spec!r}: expected NAME=RM_DIR[:TEMPLATE_FILE]")
    name, where = spec.split("=", 1)
    rm_dir, _, template = where.partition(":")
    f = batch.facts
    kept = f.rewards[i].inputs.get(name)
    if kept is None:
        raise InspectError(f"--scorer-input {name}: sample {i}'s record kept no input of a scorer {name!r} "
                           f"(it has: {', '.join(sorted(f.rewards[i].inputs)) or 'none'})")
    rows = {}
    with open(data_path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                rows[str(row.get("id"))] = row
    row = rows.get(f.prompt_id[i])
    if row is None:
        raise InspectError(f"--data {data_path}: no row with id {f.prompt_id[i]!r} (the sample's prompt_id)")
    P = f.prompt_len
    n = int(f.attention_mask[i, P:].sum())
    response = policy_tok.decode(f.response_ids[i][:n].tolist(), skip_special_tokens=True)
    contract = TokenizerContract.load(rm_dir, template or None)
    context = scorer_prompt if scorer_prompt is not None else recorded_scorer_prompt(rm_dir)[1]
    truth = {k: v for k, v in row.items() if k not in ("id", "prompt", "messages")}
    ids = render_for_scorer(contract, row.get("messages"), row.get("prompt") or "", response, context, truth)
    same = input_digest(ids) == kept
    return ([f"scorer {name}: {rm_dir}" + (f" with template {template}" if template else "")
             + (f", user turn {context!r}" if context else ""),
             f"  rendered ({len(ids)} tokens): {contract.tokenizer.decode(ids)!r}", f"  ids {ids}",
             f"  digest  {input_digest(ids)}", f"  kept    {kept}",
             "  the same input" if same else "  DIFFERS from what the scorer read"], same)


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="sealed experience directory (manifest.json + experience.safetensors)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sample", help="sample_id to show")
    which.add_argument("--index", type=int, help="index of the sample to show (default 0)")
    which.add_argument("--list", action="store_true", help="one line per sample")
    p.add_argument("--tokenizer", help="tokenizer directory: decode prompt, response and tokens")
    p.add_argument("--rederive", nargs="*", metavar="KEY=VALUE", default=None,
                   help="derive the advantages again at the recorded settings, these changed")
    p.add_argument("--scorer-input", metavar="NAME=RM_DIR[:TEMPLATE]",
                   help="render the sample again as the neural scorer NAME read it (needs --data and --tokenizer, "
                        "the policy's) and compare with the digest its record kept; exit 2 if it differs")
    p.add_argument("--data", help="the prompt file the run trained on (for --scorer-input)")
    p.add_argument("--scorer-prompt", default=None, metavar="TEMPLATE",
                   help="--scorer-input: a reference-guided model's user turn (reward.models[i].prompt; default: "
                        "the one RM_DIR records, else none)")
    args = p.parse_args(argv)

    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    batch = load_batch(args.dir)
    if args.rederive is not None:
        lines = rederive_report(batch, parse_overrides(args.rederive))
    elif args.list:
        lines = listing(batch, args.dir)
    elif args.scorer_input:
        if not (args.data and args.tokenizer):
            raise InspectError("--scorer-input needs --data (the prompt file) and --tokenizer (the policy's)")
        lines, same = scorer_input_report(batch, select(batch, args.sample, args.index), args.scorer_input,
                                          args.data, load_tokenizer(args.tokenizer), args.scorer_prompt)
        print("\n".join(lines))
        if not same:
            raise InspectError(f"--scorer-input {args.scorer_input}: the rendering differs from the kept input")
        return
    else:
        i = select(batch, args.sample, args.index)
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
        lines = describe(batch, i, args.dir, tok)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
