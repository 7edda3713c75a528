"""Run flash-linear-attention's Triton kernels on CPU tensors, under Triton's interpreter, and count them.

Only a process started with ``TRITON_INTERPRET=1`` (set before triton or fla is imported) may import this: it
changes Triton's interpreter for the whole process. It touches three of Triton's private internals, so the gpu
extra pins triton exactly:

- ``Autotuner.prune_configs``: the interpreter has no driver to time an autotuner's configs on ("0 active
  drivers"), so every autotuned kernel keeps one config, the one with the largest blocks (the interpreter pays
  per program and per operation, not per element, so the fewest programs run fastest);
- ``FunctionRewriter.ast_transformer`` (an ``ASTTransformer``): compiled Triton makes the variable of a
  ``for i in range(n)`` loop a tensor, the interpreter leaves it a Python int, and fla calls tensor methods on
  it (``i_t.to(tl.int64)``); the rewriter here makes it a tensor at the top of each such loop's body;
- ``InterpretedFunction.run``: each kernel launch is counted in ``LAUNCHES``, by kernel name.

bfloat16 is wrong under the interpreter (it computes on the raw bits): use float32 models.

transformers sends only tensors on the devices it lists for fla to fla, others to its torch reference, per
call: ``use_fla_on_cpu`` adds or removes "cpu" in each fla wrapper's list, so one process runs both paths.
"""

from __future__ import annotations

import ast
import collections
import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("fla_interpreter needs TRITON_INTERPRET=1, set before triton or fla is imported")

import torch
from triton.runtime import interpreter
from triton.runtime.autotuner import Autotuner, Config

from minifaas.model.kernels import kernel_wrappers

LAUNCHES: collections.Counter[str] = collections.Counter()  # kernel name -> launches since the last clear()


def _programs_saved(config: Config) -> int:
    """The product of a config's integer block sizes: larger blocks, fewer programs."""
    size = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool):
            size *= value
    return size


_prune_configs = Autotuner.prune_configs


def _one_config(self: Autotuner, kwargs: dict) -> list[Config]:
    return [max(_prune_configs(self, kwargs), key=_programs_saved)]


class _LoopVariablesAsTensors(interpreter.ASTTransformer):
    def visit_For(self, node: ast.For) -> ast.For:
        node = self.generic_visit(node)
        call = node.iter
        name = getattr(call.func, "id", getattr(call.func, "attr", None)) if isinstance(call, ast.Call) else None
        if name == "range" and isinstance(node.target, ast.Name):  # range and tl.range; static_range stays an int
            as_tensor = ast.Call(
                func=ast.Attribute(ast.Name("interpreter_semantic", ast.Load()), "to_tensor", ast.Load()),
                args=[ast.Name(node.target.id, ast.Load()), ast.Constant(False)],
                keywords=[],
            )
            node.body.insert(0, ast.Assign(targets=[ast.Name(node.target.id, ast.Store())], value=as_tensor))
        return node


_run = interpreter.InterpretedFunction.run


def _counted_run(self: interpreter.InterpretedFunction, *args: object, grid: object, warmup: bool, **kwargs: object):
    if not warmup:
        LAUNCHES[self.fn.__name__] += 1
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


Autotuner.prune_configs = _one_config
interpreter.FunctionRewriter.ast_transformer = _LoopVariablesAsTensors()
interpreter.InterpretedFunction.run = _counted_run


def use_fla_on_cpu(model: torch.nn.Module, on: bool) -> None:
    """Send the model's CPU tensors to fla's kernels (``on``) or to transformers' torch reference."""
    for _, cells in kernel_wrappers(model):
        if cells["package"].cell_contents == "fla":
            devices = tuple(d for d in cells["supported_devices"].cell_contents if d != "cpu")
            cells["supported_devices"].cell_contents = (*devices, "cpu") if on else devices
