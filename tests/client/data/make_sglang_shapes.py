"""Regenerate sglang_0_5_23_chat_shapes.json with SGLang's own serialisers.

Run with the SGLang interpreter: ``.venv-sglang/bin/python tests/client/data/make_sglang_shapes.py``.
The chat response and stream chunks are built by SGLang's pydantic models and SSE helpers, so the
parser test reads bytes that SGLang itself produced, not our reading of its source.
"""

import json
from pathlib import Path

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    SglExt,
    UsageInfo,
)
from sglang.srt.entrypoints.openai.sse_utils import build_sse_content
from sglang.srt.entrypoints.openai.utils import spec_tokens_details_from_meta_info

META = {
    "id": "abc",
    "spec_accept_rate": 5 / 28,
    "spec_accept_length": 2.5,
    "spec_num_correct_drafts": 5,
    "spec_num_proposed_drafts": 28,
    "spec_verify_ct": 4,
    "spec_correct_drafts_histogram": [2, 0, 1, 1, 0, 0, 0, 0],
}


def main() -> None:
    details = spec_tokens_details_from_meta_info(META)
    usage = UsageInfo(prompt_tokens=3, completion_tokens=10, total_tokens=13)
    choice = ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="hello there"), finish_reason="length"
    )
    chat = ChatCompletionResponse(
        id="abc",
        created=1,
        model="default",
        choices=[choice],
        usage=usage,
        sglext=SglExt(spec_tokens_details=details),
    )
    common = {"chunk_id": "abc", "created": 1, "model": "default", "index": 0}
    events = [
        build_sse_content(**common, role="assistant", content=""),
        build_sse_content(**common, content="hello"),
        build_sse_content(**common, content=" there"),
        build_sse_content(**common, finish_reason="length"),
    ]
    tail = {"id": "abc", "created": 1, "choices": [], "model": "default"}
    for extra in ({"sglext": SglExt(spec_tokens_details=details)}, {"usage": usage}):
        events.append(f"data: {ChatCompletionStreamResponse(**tail, **extra).model_dump_json()}\n\n")
    events.append("data: [DONE]\n\n")
    out = {"chat": json.loads(chat.model_dump_json()), "stream": "".join(events)}
    Path(__file__).with_name("sglang_0_5_23_chat_shapes.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
