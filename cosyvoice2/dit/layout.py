"""File names of a DiT token2wav directory (Step-Audio-2-mini `token2wav/`). Torch-free."""

DIT_FLOW_CONFIG = "flow.yaml"
DIT_FLOW_FILE = "flow.pt"
DIT_HIFT_FILE = "hift.pt"
DIT_HIFT_CONFIG = "hift.yaml"  # not released: only for non-default HiFT sizes
DIT_CAMPPLUS_FILE = "campplus.onnx"
DIT_SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2_25hz.onnx"

#: The released directory's files (what the build tool downloads and checks).
DIT_RELEASED_FILES = (DIT_FLOW_CONFIG, DIT_FLOW_FILE, DIT_HIFT_FILE, DIT_CAMPPLUS_FILE, DIT_SPEECH_TOKENIZER_FILE)
#: The Hugging Face repository and subfolder they come from.
DIT_HF_REPO = "stepfun-ai/Step-Audio-2-mini"
DIT_HF_SUBFOLDER = "token2wav"
