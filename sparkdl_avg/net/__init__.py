"""The network layer both servers share: frames (`frames`), one dataclass per message
(`messages`), the mutual HMAC handshake (`auth`) and one server base (`server`)."""
