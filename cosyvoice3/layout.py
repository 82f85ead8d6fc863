"""File names of a released Fun-CosyVoice3-0.5B-2512 directory. Torch-free."""

MODEL_YAML = "cosyvoice3.yaml"
LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
TOKENIZER_SUBDIR = "CosyVoice-BlankEN"
QWEN_CONFIG = f"{TOKENIZER_SUBDIR}/config.json"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"

CHECKPOINT_FILES = (LLM_FILE, FLOW_FILE, HIFT_FILE)
#: What text -> ids needs (the Qwen2 BPE files of CosyVoice-BlankEN) and what reference audio -> voice needs.
TOKENIZER_FILES = tuple(f"{TOKENIZER_SUBDIR}/{name}" for name in ("vocab.json", "merges.txt", "tokenizer_config.json"))
FRONTEND_FILES = (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
#: What the engine (LLM + token2wav) reads; the ONNX frontend files serve prompt preparation.
ENGINE_FILES = (MODEL_YAML, QWEN_CONFIG, *CHECKPOINT_FILES)
