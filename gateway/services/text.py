"""TEMPORARY placeholder until cosyvoice2.text.segment lands."""
def segment_text(text: str) -> list[str]:
    return [text.strip()] if text.strip() else []
