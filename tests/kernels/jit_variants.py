"""Which compiled variants Triton would build for the launches a piece of code makes.

Triton compiles a kernel once per *specialization key*: its constexpr values, and for every
other argument its type plus, unless the kernel opts out (``do_not_specialize``,
``do_not_specialize_on_alignment``), whether an int is 1 or a multiple of 16 and whether a
pointer is 16-byte aligned. An argument whose value or address changes with the batch (a list
length, a slice of a packed index tensor) then compiles the kernel again for batches the server
has not seen yet: seconds of host time in front of a request's first token.

:class:`JitVariants` records, for every Triton launch in its ``with`` block, the key the CUDA
backend (sm_90) would compile it under, computed by Triton's own binder from the arguments as
launched; the launch itself runs as usual (interpreted on CPU). Works with the interpreter
(``InterpretedFunction``) and compiled kernels (``JITFunction``) alike, without a GPU.
"""

from __future__ import annotations

from collections import defaultdict

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

_BACKEND = make_backend(GPUTarget("cuda", 90, 32))


def _binder(kernel):
    """(argument names, Triton's binder) of a jitted or interpreted kernel, for sm_90."""
    if isinstance(kernel, InterpretedFunction):
        opts = {k: v for k, v in kernel.kwargs.items() if k.startswith("do_not_specialize")}
    else:
        opts = {
            "do_not_specialize": kernel.do_not_specialize,
            "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
        }
    jf = JITFunction(kernel.fn, **opts)
    return jf.arg_names, create_function_from_signature(jf.signature, jf.params, _BACKEND)


class JitVariants:
    """``with JitVariants() as v: ...``, then ``v.keys[name]``: the distinct specialization keys
    of kernel ``name``'s launches, and ``v.varying(name)``: the arguments whose part of the key
    changed between launches (what makes a new variant)."""

    def __init__(self) -> None:
        self.specs: dict[str, list[dict]] = defaultdict(list)
        self._binders: dict[int, tuple] = {}
        self._saved: list[tuple[type, object]] = []

    @property
    def keys(self) -> dict[str, set[str]]:
        return {n: {repr(sorted(s.items())) for s in specs} for n, specs in self.specs.items()}

    def varying(self, name: str) -> dict[str, set[str]]:
        specs = self.specs[name]
        out = {}
        for arg in specs[0]:
            seen = {repr(s[arg]) for s in specs}
            if len(seen) > 1:
                out[arg] = seen
        return out

    def _record(self, kernel, args, kwargs) -> None:
        if id(kernel) not in self._binders:
            self._binders[id(kernel)] = _binder(kernel)
        names, binder = self._binders[id(kernel)]
        _, spec, _ = binder(*args, **kwargs)
        self.specs[kernel.fn.__name__].append(dict(zip(names, spec, strict=True)))

    def __enter__(self) -> JitVariants:
        for cls in (InterpretedFunction, JITFunction):
            original = cls.run
            self._saved.append((cls, original))

            def run(kernel, *args, grid, warmup, _original=original, **kwargs):
                self._record(kernel, args, kwargs)
                return _original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

            cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        for cls, original in self._saved:
            cls.run = original
        self._saved.clear()
