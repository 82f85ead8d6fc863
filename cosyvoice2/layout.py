"""File names of a CosyVoice2 model directory in the official layout (docs/reference/cosyvoice2.md#model-directory).

Torch-free, so the render tool and the build tooling can check a directory without loading anything.
"""

LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
TOKENIZER_SUBDIR = "CosyVoice-BlankEN"

CHECKPOINT_FILES = (LLM_FILE, FLOW_FILE, HIFT_FILE)
ONNX_FILES = (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
#: Everything the engine reads; the tokenizer entry is a directory.
MODEL_FILES = (*CHECKPOINT_FILES, *ONNX_FILES, TOKENIZER_SUBDIR)
