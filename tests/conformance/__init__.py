"""An independent worker client, written from docs/worker-protocol.md alone, and the test that runs it against a
live site: where the document and the site disagree, the test fails (see client.py)."""
