"""Conversion to and from other toolkits' formats (Hugging Face Marian, CTranslate2)."""
