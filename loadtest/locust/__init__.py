"""Locust against any OpenAI-compatible endpoint: the user (locustfile.py), load shapes and the
workload file; ``make loadtest`` runs it against ``pdgate up`` (locust_run.sh)."""
