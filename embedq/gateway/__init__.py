"""The HTTP gateway (``embedq serve``): TEI's and OpenAI's APIs over the queue. Needs the ``gateway`` extra."""
