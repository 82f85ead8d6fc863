"""File names of a Spark-TTS model directory in the released layout (``SparkAudio/Spark-TTS-0.5B``).

Torch-free, so build tooling can check a directory without loading anything.
"""

AUDIO_CONFIG_FILE = "config.yaml"
BICODEC_DIR = "BiCodec"
BICODEC_CONFIG_FILE = f"{BICODEC_DIR}/config.yaml"
BICODEC_WEIGHTS_FILE = f"{BICODEC_DIR}/model.safetensors"
LLM_DIR = "LLM"
LLM_CONFIG_FILE = f"{LLM_DIR}/config.json"
LLM_WEIGHTS_FILE = f"{LLM_DIR}/model.safetensors"
LLM_TOKENIZER_FILE = f"{LLM_DIR}/tokenizer.json"
WAV2VEC2_DIR = "wav2vec2-large-xlsr-53"
WAV2VEC2_CONFIG_FILE = f"{WAV2VEC2_DIR}/config.json"
WAV2VEC2_WEIGHTS_FILE = f"{WAV2VEC2_DIR}/pytorch_model.bin"

#: Everything the engine reads.
MODEL_FILES = (
    AUDIO_CONFIG_FILE, BICODEC_CONFIG_FILE, BICODEC_WEIGHTS_FILE, LLM_CONFIG_FILE, LLM_WEIGHTS_FILE,
    LLM_TOKENIZER_FILE, WAV2VEC2_CONFIG_FILE, WAV2VEC2_WEIGHTS_FILE,
)

#: Hugging Face repository of the released weights and their licence (the code is Apache-2.0, the weights are not).
RELEASE_REPO = "SparkAudio/Spark-TTS-0.5B"
WEIGHTS_LICENSE = "CC-BY-NC-SA-4.0"
WEIGHTS_LICENSE_URL = "https://creativecommons.org/licenses/by-nc-sa/4.0/"
