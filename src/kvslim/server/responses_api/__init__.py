"""POST /v1/responses, OpenAI's Responses API, served by the chat machinery: a request is
turned into the chat request of the same messages (so at temperature 0 its text is the chat
completion's), and the answer into Responses output items and events."""
