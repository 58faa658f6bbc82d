"""Tests of the client package, morpho_client."""
