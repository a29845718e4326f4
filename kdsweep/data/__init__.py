"""Corpora, tokenized sequences and resumable sampling."""
