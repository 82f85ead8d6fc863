"""Which speech models the gateway offers and which Triton pipeline runs each.

CosyVoice2 (`served_models`: the OpenAI names and `cosyvoice2`) is always offered. Spark-TTS (`spark_models`,
`spark-tts`) is offered while Triton has both of its models loaded and ready: the catalog asks Triton, so a
repository rendered without Spark lists no `spark-tts` and refuses it like any unknown model.
"""

from __future__ import annotations

from gateway.errors import ModelNotFound
from gateway.settings import Settings
from gateway.triton_client import Pipeline, TritonClient


class ModelCatalog:
    def __init__(self, settings: Settings, triton: TritonClient) -> None:
        self._settings = settings
        self._triton = triton
        self.default = triton.pipeline
        self.spark = Pipeline(settings.spark_offline_model, settings.spark_streaming_model)

    def pipeline_of(self, model: str) -> Pipeline | None:
        """The pipeline of a configured model id, deployed or not; None for an unknown id."""
        if model in self._settings.served_models:
            return self.default
        if model in self._settings.spark_models:
            return self.spark
        return None

    def is_known(self, model: str) -> bool:
        return self.pipeline_of(model) is not None

    async def listed(self) -> list[str]:
        """The model ids to list: CosyVoice2's, then Spark-TTS's when it is deployed."""
        models = list(self._settings.served_models)
        if self._settings.spark_models and await self._triton.is_deployed(self.spark, self._settings.ready_timeout_s):
            models += [m for m in self._settings.spark_models if m not in models]
        return models

    async def deployed(self) -> list[Pipeline]:
        """The pipelines to run a voice's warm-up on: CosyVoice2's, and Spark-TTS's when it is deployed (each
        keeps its own voice cache)."""
        if self._settings.spark_models and await self._triton.is_deployed(self.spark, self._settings.ready_timeout_s):
            return [self.default, self.spark]
        return [self.default]

    async def resolve(self, model: str) -> Pipeline:
        """The pipeline to run `model` on; an unknown or undeployed model is OpenAI's `model_not_found`."""
        pipeline = self.pipeline_of(model)
        if pipeline is None:
            raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
        if pipeline != self.default and not await self._triton.is_deployed(pipeline, self._settings.ready_timeout_s):
            raise ModelNotFound(f"The model '{model}' is not deployed on this server.", param="model")
        return pipeline
