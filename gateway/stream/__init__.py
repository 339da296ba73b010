"""The client's answer: `relay` streams the decode's events to the client (or assembles the
whole answer), and when a decode fails, places the request again and goes on from the
tokens the client already has (`continuation`); `out` is the client's response (in the
request's API, or shaped into another one's); `assemble` parses and rebuilds events, `ids`
keeps the client's ids across legs.

May import: errors, observe, upstream, instances, admission, placement."""
