"""Write engines/sglang/protocol.json from an SGLang wheel: the pinned version's server
arguments (ServerArgs fields and their CLI flags), HTTP routes and the request keys of the
routes the adapter uses. Read with ``ast`` only (SGLang is never imported: it needs CUDA).

    pip download sglang==0.5.15.post1 --no-deps -d /tmp/sgl
    python scripts/sglang_protocol.py /tmp/sgl/sglang-0.5.15.post1-*.whl engines/sglang/protocol.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile

#: io_struct request classes of the routes the adapter calls (route -> class)
REQUESTS = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}


def _classes(tree: ast.Module) -> dict:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _fields(classes: dict, name: str) -> list[str]:
    """Annotated class-level fields, bases first (BaseReq's rid, ...)."""
    cls = classes[name]
    out: list[str] = []
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out += _fields(classes, base.id)
    out += [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return list(dict.fromkeys(out))


def _server_args(source: str) -> dict:
    """ServerArgs field -> {"flag", "aliases", "kind": "switch" (store_true) | "value"}."""
    tree = ast.parse(source)
    cls = _classes(tree)["ServerArgs"]
    out = {}
    for s in cls.body:
        if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
            continue
        ann = ast.unparse(s.annotation)
        if not ann.startswith("A["):
            continue  # not a CLI argument
        flag, aliases, no_cli = "--" + s.target.id.replace("_", "-"), [], False
        for call in ast.walk(s.annotation):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "Arg":
                for kw in call.keywords:
                    if kw.arg == "cli_name":
                        flag = ast.literal_eval(kw.value)
                    elif kw.arg == "aliases":
                        aliases = [a for a in ast.literal_eval(kw.value)]
                    elif kw.arg == "no_cli":
                        no_cli = bool(ast.literal_eval(kw.value))
        if no_cli:
            continue
        first = ann[2:].split(",")[0].strip()
        kind = "switch" if first in ("bool", "Optional[bool]") and "action=" not in ann else "value"
        out[s.target.id] = {"flag": flag, "aliases": aliases, "kind": kind}
    return out


def _routes(source: str) -> dict:
    """path -> sorted methods, from @app.get/post/api_route (and @router.get/post) decorators."""
    routes: dict = {}
    for m in re.finditer(r'@(?:app|router)\.(get|post|put|delete)\(\s*"([^"]+)"', source):
        routes.setdefault(m.group(2), set()).add(m.group(1).upper())
    for m in re.finditer(r'@app\.api_route\(\s*"([^"]+)",\s*methods=\[([^\]]*)\]', source):
        routes.setdefault(m.group(1), set()).update(re.findall(r'"(\w+)"', m.group(2)))
    return {k: sorted(v) for k, v in sorted(routes.items())}


def build(wheel: str) -> dict:
    with zipfile.ZipFile(wheel) as z:
        read = lambda p: z.read(p).decode()  # noqa: E731
        version = re.search(r"sglang-([^-]+)-", wheel.rsplit("/", 1)[-1]).group(1)
        io = _classes(ast.parse(read("sglang/srt/managers/io_struct.py")))
        sampling = _classes(ast.parse(read("sglang/srt/sampling/sampling_params.py")))
        return {
            "sglang_version": version,
            "source": f"the sglang {version} wheel (PyPI), read by scripts/sglang_protocol.py",
            "server_args": _server_args(read("sglang/srt/server_args.py")),
            "routes": _routes(
                read("sglang/srt/entrypoints/http_server.py") + read("sglang/srt/entrypoints/v1_loads.py")
            ),
            "requests": {route: _fields(io, cls) for route, cls in REQUESTS.items()},
            "sampling_params": _fields(sampling, "SamplingParams"),
        }


if __name__ == "__main__":
    data = build(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{sys.argv[2]}: sglang {data['sglang_version']}, {len(data['server_args'])} server arguments, "
          f"{len(data['routes'])} routes")
