"""Triton's CPU interpreter (``TRITON_INTERPRET=1``: how CPU CI runs the kernels) made cheaper
where it repeats itself; nothing here runs on a GPU.

A kernel launch under the interpreter patches ``triton.language`` (each builtin wrapped for
numpy: ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``, ...) and undoes it when
the launch ends. A call of a ``@triton.jit`` helper from inside the kernel patches the same
modules again, once per program and call, although they are patched already; that repeat
(and its scope, never undone) was about a fifth of an interpreted decode step. With
:func:`skip_nested_language_patches` a helper's call inside a launch whose patch covers its
language modules patches nothing; the first call of a launch, and any call needing a module
the launch has not patched yet (``tl.sum`` and the other ``triton.language.standard``
helpers need ``tl.core``), go through Triton's own code unchanged.
"""

from __future__ import annotations

import inspect
import threading


def skip_nested_language_patches() -> bool:
    """Install the skip (once per process); False when this Triton has no interpreter hook of
    the expected shape (then nothing is changed)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:
        return False
    if getattr(original, "skips_nested", False):  # installed already
        return True
    state = threading.local()  # .patched: the modules this thread's launch in progress has patched (else None)

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        patched, langs = getattr(state, "patched", None), languages(fn)
        if patched is not None and langs <= patched:
            return scope_type()  # patched by the launch already: an empty scope
        scope = original(fn)
        if patched is not None:  # a helper needing another module (tl.sum's: tl.core): patched as Triton does;
            patched |= langs  # Triton never undoes a helper's patch, so it holds for the rest of the launch
            return scope
        state.patched = langs  # a launch (GridExecutor): until its scope is undone
        undo = scope.restore

        def restore() -> None:
            state.patched = None
            undo()

        scope.restore = restore
        return scope

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
    return True
