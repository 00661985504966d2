"""Tokenizer directories in the style of the model families, shared by the format tests."""
import pytest

from family_tokenizer_fixtures import build_harmony_style_tokenizer, build_llama3_style_tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_llama3_style_tokenizer(tmp_path_factory.mktemp("llama3_style"))


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory):
    return build_harmony_style_tokenizer(tmp_path_factory.mktemp("harmony_style"))
