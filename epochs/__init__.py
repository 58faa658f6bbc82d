"""Epoch records and live row updates: what each party's engine serves, kept in the database."""
