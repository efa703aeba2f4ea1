"""Record the parts of SGLang's API that megarl's sglang backend calls, from a release's source.

    python docker/sglang_api/record.py 0.5.23            # downloads the wheel (pip, no deps, ~40 MB)
    python docker/sglang_api/record.py 0.5.23 --src DIR  # DIR holds an unpacked wheel (DIR/sglang/...)

writes ``docker/sglang_api/sglang-<version>.json``.  Nothing is imported from SGLang (importing it
needs its CUDA stack): every entry is read from the source text with ``ast``, and every entry
names the file it came from, so a reader can check it.  ``tests/unit/rollout/test_sglang_api_contract.py``
builds a fake engine from these files and drives ``SGLangRolloutEngine`` against it; bumping
SGLang means recording the new release and letting that test say what changed.

What is recorded (paths relative to ``python/sglang/srt`` of the release):

* ``engine``: the ``Engine`` methods the backend calls, their parameter names, and what they
  return (the tokenizer manager's return annotation, e.g. ``Tuple[bool, str]``);
* ``weight_update_session``: whether ``update_weights_from_tensor`` is refused outside
  ``begin_weight_update()`` / ``end_weight_update()`` (0.5.21+), with the refusal message;
* ``memory``: the memory-saver tags, which tags ``None`` means on release and on resume, and
  whether resuming a tag that was not released raises in the scheduler (``offload_tags.remove``),
  which the scheduler answers by signalling the parent process (``SIGQUIT``);
* ``server_args_fields`` / ``sampling_params_fields``: the names ``Engine(**kwargs)`` and a
  ``sampling_params`` dict accept;
* ``flattened_bucket``: where ``FlattenedTensorBucket`` lives and whether it flattens to uint8
  with byte offsets; ``serializer``: ``MultiprocessingSerializer`` and the globals its safe
  unpickler admits from SGLang's own modules;
* ``raw_logprob_env``: the environment switch for log-probs before temperature;
* ``parent_env_overrides``: environment variables ``Engine()`` sets in the calling process;
* ``finish_reason``: the keys of ``meta_info["finish_reason"]``; ``eos``: where the ids SGLang
  stops on come from; ``sampling_seed``: whether a per-request seed needs deterministic inference;
* ``routed_experts``: the request option and server flag that return each request's routed
  experts (0.5.7+), where the output puts them, in which encoding, dtype, rows and layers, and
  whether the captured ids are logical or physical experts;
* ``weight_checker``: ``CheckWeightsReqInput``'s fields, the actions SGLang's weight checker
  accepts and what ``TokenizerManager.check_weights`` returns (None before 0.5.7).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
#: Engine methods megarl calls (begin/end_weight_update only where they exist)
ENGINE_METHODS = (
    "__init__", "generate", "update_weights_from_tensor", "begin_weight_update", "end_weight_update",
    "flush_cache", "release_memory_occupation", "resume_memory_occupation", "shutdown",
)
SESSION_MESSAGE = "must run between begin_weight_update() and end_weight_update()"


class Source:
    def __init__(self, root: str):
        self.root = root  # the directory holding the ``sglang`` package

    def path(self, rel: str) -> str:
        return os.path.join(self.root, "sglang", "srt", rel)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def text(self, rel: str) -> str:
        with open(self.path(rel), encoding="utf-8") as f:
            return f.read()

    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.text(rel))

    def files(self, sub: str = ""):
        base = self.path(sub)
        for d, _, names in os.walk(base):
            for n in sorted(names):
                if n.endswith(".py"):
                    yield os.path.relpath(os.path.join(d, n), self.path(""))

    def find(self, needle: str, sub: str = "") -> list[str]:
        """``file:line`` of every line containing ``needle``."""
        hits = []
        for rel in self.files(sub):
            for i, line in enumerate(self.text(rel).splitlines(), 1):
                if needle in line:
                    hits.append(f"{rel}:{i}")
        return hits


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _params(fn: ast.FunctionDef) -> dict:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]
    return {"params": names, "var_keyword": a.kwarg is not None}


def _release_version(src: Source) -> str:
    dist = [d for d in os.listdir(src.root) if d.startswith("sglang-") and d.endswith(".dist-info")]
    if dist:
        with open(os.path.join(src.root, dist[0], "METADATA"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    raise SystemExit(f"{src.root}: no sglang-*.dist-info/METADATA (unpack the wheel there)")


def _tokenizer_manager_returns(src: Source) -> dict[str, str]:
    """Return annotation of each TokenizerManager method the Engine methods wrap."""
    out = {}
    for rel in src.files("managers"):
        if "tokenizer" not in rel:
            continue
        for node in ast.walk(src.tree(rel)):
            if isinstance(node, ast.AsyncFunctionDef) and node.name in ENGINE_METHODS:
                if node.returns is not None:
                    out.setdefault(node.name, f"{ast.unparse(node.returns)} ({rel}:{node.lineno})")
                elif not any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node)):
                    out.setdefault(node.name, f"None ({rel}:{node.lineno})")
    return out


def record_engine(src: Source) -> dict:
    rel = "entrypoints/engine.py"
    cls = _class(src.tree(rel), "Engine")
    methods = _methods(cls)
    returns = _tokenizer_manager_returns(src)
    out = {}
    for name in ENGINE_METHODS:
        if name in methods:
            entry = _params(methods[name])
            entry["source"] = f"{rel}:{methods[name].lineno}"
            if name in returns:
                entry["returns"] = returns[name]
            out[name] = entry
    return {"module": "sglang.srt.entrypoints.engine", "class": "Engine", "methods": out}


def _string_constants(src: Source, sub: str, needle: str, function: str) -> list[str]:
    """``file:line`` of ``function`` definitions holding a string literal containing ``needle``
    (implicit concatenation joined)."""
    hits = []
    for rel in src.files(sub):
        for fn in ast.walk(src.tree(rel)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == function:
                if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and needle in n.value
                       for n in ast.walk(fn)):
                    hits.append(f"{rel}:{fn.lineno}")
    return hits


def record_session(src: Source, engine: dict) -> dict:
    hits = _string_constants(src, "managers", SESSION_MESSAGE, "update_weights_from_tensor")
    has = {"begin_weight_update", "end_weight_update"} <= set(engine["methods"])
    return {
        "methods": ["begin_weight_update", "end_weight_update"] if has else None,
        "required_for_update_weights_from_tensor": bool(hits),
        "rejection_message": ("update_weights_from_tensor " + SESSION_MESSAGE) if hits else None,
        "source": hits[0] if hits else None,
    }


def _list_of_names(node: ast.AST, consts: dict[str, str]) -> list[str] | None:
    if isinstance(node, (ast.List, ast.Tuple)):
        vals = []
        for e in node.elts:
            if isinstance(e, ast.Name) and e.id in consts:
                vals.append(consts[e.id])
            elif isinstance(e, ast.Constant):
                vals.append(e.value)
            else:
                return None
        return vals
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    return None


def record_memory(src: Source) -> dict:
    consts: dict = {}
    for node in src.tree("constants.py").body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if isinstance(node.value, ast.Constant):
                consts[name] = node.value.value
            else:
                vals = _list_of_names(node.value, consts)
                if vals is not None:
                    consts[name] = vals
    tags = {k: v for k, v in consts.items() if k.startswith("GPU_MEMORY_TYPE_")}
    out = {"tags": tags, "all_types": consts.get("GPU_MEMORY_ALL_TYPES"), "source": "constants.py"}
    for rel in src.files("managers"):
        tree = src.tree(rel)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and node.name in ("release_memory_occupation", "resume_memory_occupation")):
                continue
            if not any(isinstance(a, ast.arg) and a.arg == "recv_req" for a in node.args.args):
                continue
            kind = node.name.split("_")[0]
            for sub in ast.walk(node):  # `tags = <default>` inside `if tags is None ...`
                if isinstance(sub, ast.If) and "tags is None" in ast.unparse(sub.test):
                    for stmt in sub.body:
                        if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "tags":
                            out[f"{kind}_default"] = _list_of_names(stmt.value, consts)
            body = ast.unparse(node)
            if kind == "resume" and "offload_tags.remove(" in body:
                out["resume_unreleased_tag_raises"] = "KeyError (offload_tags.remove)"
            out[f"{kind}_source"] = f"{rel}:{node.lineno}"
    kills = sorted(src.find("parent_process.send_signal(signal.SIGQUIT)", "managers"),
                   key=lambda h: not h.startswith("managers/scheduler.py"))
    out["scheduler_exception_kills_parent"] = kills[0] if kills else None
    return out


def record_server_args(src: Source) -> dict:
    if src.exists("arg_groups/field_order.py"):  # 0.5.2x: fields assembled from namespaces
        tree = src.tree("arg_groups/field_order.py")
        for node in tree.body:
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "POSITIONAL_FIELD_ORDER":
                fields = [e.value for e in node.value.elts]
                return {"fields": sorted(set(fields)), "source": "arg_groups/field_order.py (POSITIONAL_FIELD_ORDER)"}
    cls = _class(src.tree("server_args.py"), "ServerArgs")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return {"fields": sorted(fields), "source": f"server_args.py:{cls.lineno} (dataclass fields)"}


def record_sampling_params(src: Source) -> dict:
    rel = "sampling/sampling_params.py"
    cls = _class(src.tree(rel), "SamplingParams")
    init = _methods(cls).get("__init__")
    if init is not None:
        fields = _params(init)["params"]
    else:  # msgspec.Struct
        fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return {"fields": fields, "source": f"{rel}:{cls.lineno}"}


def record_finish_reason(src: Source) -> dict:
    rel = "managers/schedule_batch.py"
    tree = src.tree(rel)
    out = {}
    for name in ("FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"):
        cls = _class(tree, name)
        to_json = _methods(cls)["to_json"]
        for n in ast.walk(to_json):
            if isinstance(n, ast.Dict):
                keys = [k.value for k in n.keys if isinstance(k, ast.Constant)]
                typ = [v.value for k, v in zip(n.keys, n.values) if isinstance(k, ast.Constant) and k.value == "type"]
                out[name] = {"keys": keys, "type": typ[0] if typ else None, "source": f"{rel}:{cls.lineno}"}
                break
    return out


def record_bucket(src: Source) -> dict:
    rel = "weight_sync/tensor_bucket.py"
    text = src.text(rel)
    tree = ast.parse(text)
    meta = _class(tree, "FlattenedTensorMetadata")
    fields = [n.target.id for n in meta.body if isinstance(n, ast.AnnAssign)]
    return {
        "module": "sglang.srt.weight_sync.tensor_bucket",
        "metadata_fields": fields,
        "offsets": "bytes" if ".view(torch.uint8)" in text else "elements",
        "multi_dtype": "supports_multi_dtypes = True" in text,
        "source": rel,
    }


def record_serializer(src: Source) -> dict:
    hits = [h for h in src.find("class MultiprocessingSerializer", "utils")] or src.find("class MultiprocessingSerializer")
    rel = hits[0].split(":")[0]
    text = src.text(rel)
    allowed = sorted(set(re.findall(r'\("(sglang\.[\w.]+)",\s*"(\w+)"\)', text)))
    prefixes = []  # 0.5.5 .. 0.5.20 admit whole modules by prefix
    block = re.search(r"ALLOWED_MODULE_PREFIXES\s*=\s*\{(.*?)\}", text, re.S)
    if block:
        prefixes = sorted(re.findall(r'"([\w.]+\.)"', block.group(1)))
    return {
        "module": "sglang.srt.utils",
        "class": "MultiprocessingSerializer",
        "safe_unpickler": "class SafeUnpickler" in text,
        "allowed_sglang_globals": [f"{m}.{n}" for m, n in allowed],
        "allowed_module_prefixes": prefixes,
        "source": hits[0],
    }


def record_patch_torch(src: Source) -> dict:
    if src.exists("utils/patch_torch.py"):
        return {"module": "sglang.srt.utils.patch_torch", "function": "monkey_patch_torch_reductions"}
    return {"module": "sglang.srt.patch_torch", "function": "monkey_patch_torch_reductions"}


def record_raw_logprob_env(src: Source) -> dict:
    names = set()
    for rel in src.files("layers"):
        names.update(re.findall(r'get_bool_env_var\(\s*"(\w*RETURN_ORIGINAL_LOGPROB)"', src.text(rel)))
        names.update(re.findall(r"envs\.(\w*RETURN_ORIGINAL_LOGPROB)\.get\(\)", src.text(rel)))
    return {"names": sorted(names), "source": "layers/sampler.py"}


def record_parent_env(src: Source) -> dict:
    rel = "entrypoints/engine.py"
    tree = src.tree(rel)
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_set_envs_and_config":
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Assign) and isinstance(sub.targets[0], ast.Subscript)
                        and ast.unparse(sub.targets[0].value) == "os.environ"):
                    key = ast.unparse(sub.targets[0].slice).strip("'\"")
                    out[key] = sub.value.value if isinstance(sub.value, ast.Constant) else "<computed>"
            return {"vars": out, "source": f"{rel}:{node.lineno} (_set_envs_and_config)"}
    return {"vars": out, "source": None}


def record_sampling_seed(src: Source) -> dict:
    rel = "sampling/sampling_batch_info.py"
    text = src.text(rel)
    gated = "if enable_deterministic" in text and "sampling_seed" in text
    return {"requires_enable_deterministic_inference": gated, "source": rel}


def record_eos(src: Source) -> dict:
    rel = "configs/model_config.py"
    tree = src.tree(rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_get_hf_eos_token_id":
            body = ast.unparse(node)
            sources = ["config.json eos_token_id"]
            if "hf_generation_config" in body:
                sources.append("generation_config.json eos_token_id")
            stop = [h for h in src.find("sampling_params.stop_token_ids", "managers") if "schedule_batch.py" in h]
            return {"engine_stops_on": sources + ["sampling_params.stop_token_ids"],
                    "source": f"{rel}:{node.lineno}", "check_source": stop[0] if stop else None}
    return {}


def _capturer_file(src: Source) -> str | None:
    for rel in ("state_capturer/routed_experts.py", "layers/moe/routed_experts_capturer.py"):
        if src.exists(rel):
            return rel
    return None


def _capture_site(src: Source) -> dict:
    """Where top-k ids are captured in ``layers/moe/topk.py``, and whether that is before the
    logical -> physical expert map (ids are then logical even with redundant experts / EPLB)."""
    rel = "layers/moe/topk.py"
    for fn in ast.walk(src.tree(rel)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "capture_routed_experts_if_allowed":
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and (
            ast.unparse(n.func) in ("capture_routed_experts_if_allowed", "get_global_experts_capturer().capture"))]
        if calls:
            line = min(c.lineno for c in calls)
            maps = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call)
                    and ast.unparse(n.func) == "topk_ids_logical_to_physical"]
            ids = "logical" if any(m > line for m in maps) else "physical"
            return {"source": f"{rel}:{line} ({fn.name})", "ids": ids}
    return {"source": None, "ids": None}


def record_routed_experts(src: Source, engine: dict, server_args: dict) -> dict:
    """``Engine.generate(return_routed_experts=True)`` on an engine started with
    ``enable_return_routed_experts``: ``meta_info["routed_experts"]`` holds the top-k ids of tokens
    ``[start, seqlen - 1)`` (prompt + output; the last output token is never fed), every decoder
    layer (``num_hidden_layers``) x ``num_experts_per_tok``, int32.  With ``skip_tokenizer_init``
    (this backend) the tokenizer manager gets the scheduler's tensor: base64 of its bytes where it
    encodes it, else the tensor itself."""
    params = engine["methods"]["generate"]["params"]
    option = "return_routed_experts" if "return_routed_experts" in params else None
    out = {"request_option": option,
           "start_len_option": "routed_experts_start_len" if "routed_experts_start_len" in params else None,
           "server_flag": "enable_return_routed_experts" if "enable_return_routed_experts" in server_args["fields"] else None}
    cap = _capturer_file(src)
    if option is None or cap is None:
        return out
    tm = "managers/tokenizer_manager.py"
    lines = src.text(tm).splitlines()
    hits = [i for i, line in enumerate(lines) if 'meta_info["routed_experts"]' in line]
    encoded = any("b64encode" in line for i in hits for line in lines[max(0, i - 6): i + 1])
    text = src.text(cap)
    out.update({
        "meta_info_key": "routed_experts" if hits else None,
        "meta_info_source": f"{tm}:{hits[0] + 1}" if hits else None,
        "encoding_with_skip_tokenizer_init": "base64" if encoded else "tensor",
        "dtype": "int32" if "dtype=torch.int32" in text or "dtype=torch.int32" in src.text("state_capturer/base.py" if src.exists("state_capturer/base.py") else cap) else None,
        "rows": "[start, seqlen - 1)" if "seqlen - 1]" in text + (src.text("state_capturer/base.py") if src.exists("state_capturer/base.py") else "") else None,
        "layers": "num_hidden_layers" if "hf_text_config.num_hidden_layers" in text else None,
        "top_k": "num_experts_per_tok" if "hf_text_config.num_experts_per_tok" in text else None,
        "capturer_source": cap,
        "capture": _capture_site(src),
    })
    return out


def record_weight_checker(src: Source) -> dict | None:
    """SGLang's weight checker (``utils/weight_checker.py``, 0.5.7+), or None: the fields of
    ``CheckWeightsReqInput``, the actions ``WeightChecker.handle`` accepts, and what the tokenizer
    manager's ``check_weights`` returns (0.5.23: ``(success, message, ranks, per_engine_checksum)``
    with each rank's parameter checksums; 0.5.7: a ``CheckWeightsReqOutput`` and no checksum)."""
    io_rel, rel = "managers/io_struct.py", "utils/weight_checker.py"
    req = _class(src.tree(io_rel), "CheckWeightsReqInput") if src.exists(io_rel) else None
    checker = _class(src.tree(rel), "WeightChecker") if src.exists(rel) else None
    if req is None or checker is None:
        return None
    fields = [n.target.id for n in req.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    handle = _methods(checker)["handle"]
    actions = sorted({c.comparators[0].value for c in ast.walk(handle)
                      if isinstance(c, ast.Compare) and isinstance(c.left, ast.Name) and c.left.id == "action"
                      and isinstance(c.comparators[0], ast.Constant)})
    returns = None
    for mrel in src.files("managers"):
        if "tokenizer" not in mrel:
            continue
        for node in ast.walk(src.tree(mrel)):
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "check_weights" and node.returns is not None:
                returns = returns or f"{ast.unparse(node.returns)} ({mrel}:{node.lineno})"
    return {"request": {"module": "sglang.srt.managers.io_struct", "class": "CheckWeightsReqInput",
                        "fields": fields, "source": f"{io_rel}:{req.lineno}"},
            "actions": actions, "actions_source": f"{rel}:{handle.lineno}",
            "tokenizer_manager_returns": returns}


def record(src_root: str) -> dict:
    src = Source(src_root)
    version = _release_version(src)
    engine = record_engine(src)
    return {
        "sglang_version": version,
        "recorded_from": f"sglang-{version} wheel (python/sglang/srt/...), by docker/sglang_api/record.py",
        "engine": engine,
        "weight_update_session": record_session(src, engine),
        "memory": record_memory(src),
        "server_args": record_server_args(src),
        "sampling_params": record_sampling_params(src),
        "finish_reason": record_finish_reason(src),
        "flattened_bucket": record_bucket(src),
        "serializer": record_serializer(src),
        "patch_torch": record_patch_torch(src),
        "raw_logprob_env": record_raw_logprob_env(src),
        "parent_env_overrides": record_parent_env(src),
        "sampling_seed": record_sampling_seed(src),
        "eos": record_eos(src),
        "routed_experts": record_routed_experts(src, engine, record_server_args(src)),
        "weight_checker": record_weight_checker(src),
    }


def _unpacked_wheel(version: str, tmp: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "-d", tmp],
                   check=True)
    wheel = [f for f in os.listdir(tmp) if f.endswith(".whl")][0]
    out = os.path.join(tmp, "src")
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        z.extractall(out, [n for n in z.namelist() if n.startswith(("sglang/srt/", "sglang-"))])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version")
    ap.add_argument("--src", help="directory holding an unpacked sglang wheel")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = a.src or _unpacked_wheel(a.version, tmp)
        desc = record(root)
    if desc["sglang_version"] != a.version:
        raise SystemExit(f"asked for {a.version}, the source is {desc['sglang_version']}")
    out = a.out or os.path.join(HERE, f"sglang-{a.version}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(desc, f, indent=1, sort_keys=True)
        f.write("\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
