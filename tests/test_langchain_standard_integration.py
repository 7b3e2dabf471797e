"""langchain-tests' standard chat-model integration suite against ChatQCFuse on the embedded
SmolLM2-135M-Instruct (CPU). Each test the suite skips for a capability we do not claim
(images, audio, PDFs, model override) is skipped by the suite itself from our properties;
the tests a 135M model cannot pass are marked xfail(strict=True) with the reason, so they
fail the run if they start to pass (and the list here must then be updated)."""

from __future__ import annotations

import tempfile

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from qcfuse_integrations.langchain import ChatQCFuse

pytestmark = pytest.mark.slow

_STORE = tempfile.mkdtemp(prefix="qcfuse-chat-integration-")


class TestChatQCFuseIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self):
        return ChatQCFuse

    @property
    def chat_model_params(self) -> dict:
        return {"store_dir": _STORE}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True
