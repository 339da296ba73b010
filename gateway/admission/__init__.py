"""Who is asking and where they may go: API keys and their priorities (`auth`), tenants and
their shares (`tenancy`), the scenario group that serves a request and its limits (`groups`).

May import: errors, observe, instances."""
