"""Uploads share one temporary folder per dashboard session: a second upload makes no new folder."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest


def _script() -> None:
    import tempfile

    import streamlit as st

    from dflash_doctor.app import ui

    made = st.session_state.setdefault("made", [])
    real = tempfile.mkdtemp

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    tempfile.mkdtemp = counting
    try:
        for i in range(4):  # four uploads that fail to parse: each shows its sentence, none opens
            ui._register_upload([(f"bad-{i}.zip", b"not a zip" * (i + 1))])
    finally:
        tempfile.mkdtemp = real


def test_uploads_reuse_one_temporary_folder_per_session():
    at = AppTest.from_function(_script, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 4  # each bad upload said why
    assert len(at.session_state["made"]) == 1
