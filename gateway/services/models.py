"""Which speech models the gateway offers and which Triton pipeline runs each.

CosyVoice2 (`served_models`: the OpenAI names and `cosyvoice2`) is always offered. Spark-TTS (`spark_models`,
`spark-tts`) and CosyVoice3 (`cosyvoice3_models`, `cosyvoice3`) are offered while Triton has both models of their
pipeline loaded and ready: the catalog asks Triton, so a repository rendered without them lists neither and refuses
them like any unknown model. Whether a model has an instruct mode (OpenAI's `instructions`) is the catalog's too,
so a request it cannot honour is refused before anything is synthesized.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import InvalidRequest, ModelNotFound
from gateway.settings import Settings
from gateway.triton_client import Pipeline, TritonClient


@dataclass(frozen=True)
class OptionalModel:
    """A model served only where its pipeline is deployed: its ids, its Triton models, whether it has an instruct
    mode."""

    name: str  # as the error messages say it
    ids: tuple[str, ...]
    pipeline: Pipeline
    instructions: bool


class ModelCatalog:
    def __init__(self, settings: Settings, triton: TritonClient) -> None:
        self._settings = settings
        self._triton = triton
        self.default = triton.pipeline
        self.optional = (
            OptionalModel("Spark-TTS", tuple(settings.spark_models),
                          Pipeline(settings.spark_offline_model, settings.spark_streaming_model), instructions=False),
            OptionalModel("CosyVoice3", tuple(settings.cosyvoice3_models),
                          Pipeline(settings.cosyvoice3_offline_model, settings.cosyvoice3_streaming_model),
                          instructions=True),
        )  # fmt: skip

    def _optional_of(self, model: str) -> OptionalModel | None:
        if model in self._settings.served_models:
            return None
        return next((entry for entry in self.optional if model in entry.ids), None)

    def pipeline_of(self, model: str) -> Pipeline | None:
        """The pipeline of a configured model id, deployed or not; None for an unknown id."""
        if model in self._settings.served_models:
            return self.default
        entry = self._optional_of(model)
        return entry.pipeline if entry is not None else None

    def is_known(self, model: str) -> bool:
        return self.pipeline_of(model) is not None

    def check_instructions(self, model: str) -> None:
        """OpenAI's `instructions` for a model without an instruct mode: a 400 naming the parameter (the pipeline
        would refuse it too, but only after the voice reached it)."""
        entry = self._optional_of(model)
        if entry is not None and not entry.instructions:
            raise InvalidRequest(
                f"The model '{model}' has no instruct mode ({entry.name} speaks only in the voice's own style): "
                "send the request without instructions.",
                param="instructions",
                code="unsupported_value",
            )

    async def _deployed_optional(self) -> list[OptionalModel]:
        timeout_s = self._settings.ready_timeout_s
        return [entry for entry in self.optional
                if entry.ids and await self._triton.is_deployed(entry.pipeline, timeout_s)]

    async def listed(self) -> list[str]:
        """The model ids to list: CosyVoice2's, then those of each optional model that is deployed."""
        models = list(self._settings.served_models)
        for entry in await self._deployed_optional():
            models += [m for m in entry.ids if m not in models]
        return models

    async def deployed(self) -> list[Pipeline]:
        """The pipelines to run a voice's warm-up on: CosyVoice2's and every deployed optional one (each keeps its
        own voice cache)."""
        return [self.default, *(entry.pipeline for entry in await self._deployed_optional())]

    async def resolve(self, model: str) -> Pipeline:
        """The pipeline to run `model` on; an unknown or undeployed model is OpenAI's `model_not_found`."""
        pipeline = self.pipeline_of(model)
        if pipeline is None:
            raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
        if pipeline != self.default and not await self._triton.is_deployed(pipeline, self._settings.ready_timeout_s):
            raise ModelNotFound(f"The model '{model}' is not deployed on this server.", param="model")
        return pipeline
