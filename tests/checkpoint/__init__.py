"""Tests of dsfunc.checkpoint, one file per module of the package."""
