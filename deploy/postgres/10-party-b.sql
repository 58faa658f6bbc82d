-- Run once by the postgres image on an empty data volume: party B gets its own database
-- (party A's is POSTGRES_DB). The parties share a server here, never a database.
CREATE DATABASE party_b;
