"""pagoda's HTTP front end: an OpenAI-compatible API over engine.AsyncEngine."""
