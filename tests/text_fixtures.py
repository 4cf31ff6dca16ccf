"""Old import path of tests/helpers/text_data.py, kept only for test files that still import it;
new code imports `helpers.text_data`. Delete this file once nothing imports it."""

from helpers.text_data import rows, write_dataset  # noqa: F401
