"""Voice-prompt frontend: audio loading/resampling, acoustic features, ONNX models, VoicePrompt."""
