"""Template filling: a model of the rendered repository is one `ModelSpec` (its template, tensors, typed
parameters, adapter and the template's other placeholders); `model_files` turns a table of them into files.

Every template (`templates/*.pbtxt`) has `${name}`, `${inputs}`, `${outputs}` and `${parameters}`; the rest of a
template's placeholders come from the spec's `values`. A placeholder left unfilled is an error. Shared by
CosyVoice2's models (`triton_repo.render_models`), Spark-TTS's (`triton_repo.spark_render`) and CosyVoice3's
(`triton_repo.cosyvoice3_render`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from string import Template
from typing import Mapping, Sequence, TypeVar

import pipeline_contract as contract
from pipeline_contract import TensorSpec
from triton_repo import internal_io as io
from triton_repo.model_params import ModelParams
from triton_repo.render_options import RenderError, RenderOptions

TEMPLATES = Path(__file__).resolve().parent / "templates"
_P = TypeVar("_P", bound=ModelParams)
ADAPTERS = "triton_repo.adapters"


@dataclass(frozen=True)
class ModelSpec:
    """One model of the repository. `adapter`: (module of `triton_repo.adapters`, class) of a python-backend model;
    None for a backend that needs only the version directory (tensorrtllm: the engine stays where it was built)."""

    name: str
    template: str
    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    parameters: ModelParams | Mapping[str, object]
    adapter: tuple[str, str] | None
    values: Mapping[str, object] = field(default_factory=dict)


def parameters_block(values: ModelParams | Mapping[str, object]) -> str:
    """The `parameters { ... }` entries of a config, sorted by key."""
    if isinstance(values, ModelParams):
        values = dict(values.to_parameters())
    return "\n".join(
        f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}' for key, value in sorted(values.items())
    )


def fill(template: str, **values: object) -> str:
    text = Template((TEMPLATES / template).read_text()).safe_substitute({k: str(v) for k, v in values.items()})
    leftover = sorted(set(re.findall(r"\$\{(\w+)\}", text)))
    if leftover:
        raise RenderError(f"template {template}: unresolved placeholders {', '.join(leftover)}")
    return text


def python_model(module: str, cls: str = "TritonPythonModel") -> str:
    """The rendered `model.py` of a python-backend model: an import of its adapter class."""
    return fill("model.py.tmpl", module=f"{ADAPTERS}.{module}", cls=cls)


def entry_specs(opts: RenderOptions, params: ModelParams, adapter: tuple[str, str], offline: tuple[str, str],
                streaming: tuple[str, str]) -> list[ModelSpec]:
    """A pipeline's two entry models, (name, description) each: the contract's tensors, one adapter and its
    parameters, the offline one plain and the streaming one decoupled; their instances as `--instances` says."""
    return [
        ModelSpec(name, "orchestrator.pbtxt", contract.INPUTS, contract.OUTPUTS, params, adapter,
                  dict(description=description, decoupled=decoupled, instances=opts.instances_of(name)))
        for (name, description), decoupled in ((offline, "false"), (streaming, "true"))
    ]


def engine_entry_spec(name: str, params: ModelParams, adapter: tuple[str, str]) -> ModelSpec:
    """A streaming entry model that hosts its pipeline's engine (`adapters.engine_entry`): the contract's tensors
    and the engine's (`engine_entry_tensors`), one instance."""
    return ModelSpec(name, "engine_entry.pbtxt", *engine_entry_tensors(), params, adapter)


def engine_entry_tensors() -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of the streaming entry model that hosts the engine: the contract's and the engine's, every
    input optional (a request carries one set); a tensor both name (seed, waveform) is the same tensor once."""

    def union(*groups: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        merged: dict[str, TensorSpec] = {}
        for spec in (s for group in groups for s in group):
            if spec.name in merged and (merged[spec.name].triton_dtype, merged[spec.name].dims) != (
                    spec.triton_dtype, spec.dims):
                raise RenderError(f"{spec.name}: the contract's and the engine's tensors differ")
            merged.setdefault(spec.name, spec)
        return tuple(merged.values())

    inputs = union((replace(spec, optional=True) for spec in contract.INPUTS), io.ENGINE_INPUTS)
    return inputs, union(contract.OUTPUTS, io.ENGINE_OUTPUTS)


def with_options(params: type[_P], opts: RenderOptions, **given: object) -> _P:
    """`params` built from `given`, its other fields taken from the options' fields of the same name: an option
    that passes straight into a model's parameters is named alike on both sides and written nowhere else (a field
    of the same name that means something else for this model is given)."""
    shared = {f.name for f in fields(params)} & {f.name for f in fields(opts)}
    return params(**{name: getattr(opts, name) for name in shared - given.keys()}, **given)


def model_files(specs: Sequence[ModelSpec]) -> dict[str, str]:
    """Relative path -> content of every model of `specs`: its config and its version directory."""
    files: dict[str, str] = {}
    for spec in specs:
        files[f"{spec.name}/config.pbtxt"] = fill(
            spec.template,
            name=spec.name,
            inputs=contract.pbtxt_io_block("input", spec.inputs),
            outputs=contract.pbtxt_io_block("output", spec.outputs),
            parameters=parameters_block(spec.parameters),
            **spec.values,
        )
        if spec.adapter is None:
            files[f"{spec.name}/1/.keep"] = ""  # the backend needs the version directory
        else:
            files[f"{spec.name}/1/model.py"] = python_model(*spec.adapter)
    return files
