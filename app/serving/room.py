"""The classroom: who is in the room, under which label, and what each role may do.

    room = Room(reserved=[name for name, _ in USERS])
    member = room.join("Ana")            # label "Ana", or "Ana 2" when "Ana" is taken; ValueError if bad
    room.slot("some-api-user")           # every label gets a slot: colour = slot % 8, mark = slot // 8
    room.leave(member.token)             # gone from the room; "Ana" stays taken (the chart still shows her)

Students join with a display name and get a token (kept in their tab); the token
is all their page holds, and it allows exactly one thing: chatting under their
label. Labels are unique in the room (compared case-insensitively) and never
reused while the server runs, since the chart may still show old rows. Every
label seen on the step stream (students, the lecturer's panels, OpenAI `user`
fields) gets a slot in order of first sight, so a label has the same colour and
mark on every screen. A student who leaves frees their place in the room
(MAX_MEMBERS counts the people in it now), not their label.
"""
from __future__ import annotations

import random
import re
import secrets
import socket
import unicodedata
from collections import deque
from dataclasses import dataclass, field

MAX_NAME = 24                 # characters of a display name; "Ana 99" still fits the engine's 32
MAX_MEMBERS = 1000            # students in one room (a lecture hall is far smaller)
MAX_SLOTS = 4096              # labels numbered; later ones stay grey
SLOT_COLOURS = 8              # static/palette.js: Okabe-Ito colours, the lecturer's panel users' in order
SLOT_SIGNS = 10               # static/palette.js MARKS: a mark on the swatch tells slots of one colour apart
MARKUP = re.compile(r"[<>&\"'`]")
ADJECTIVES = ["Curious", "Brave", "Quiet", "Swift", "Clever", "Gentle", "Lucky", "Sunny", "Bold", "Calm",
              "Keen", "Merry", "Noble", "Witty", "Jolly", "Eager"]
ANIMALS = ["Otter", "Falcon", "Panda", "Lynx", "Heron", "Koala", "Badger", "Dolphin", "Fox", "Owl",
           "Tiger", "Yak", "Gecko", "Robin", "Bison", "Crane"]


@dataclass
class Member:
    token: str
    label: str
    rids: deque = field(default_factory=lambda: deque(maxlen=64))   # this student's request ids, newest last
    history: list[dict] = field(default_factory=list)              # the chat the engine sees (complete turns)
    busy: bool = False                                              # a reply is streaming
    stream: object | None = None                                    # that reply's stream (closed on leave)


def check_name(name) -> str:
    """The display name, tidied (spaces collapsed); ValueError with the reason when it cannot be used."""
    if not isinstance(name, str):
        raise ValueError("the name must be text")
    name = " ".join(unicodedata.normalize("NFC", name).split())
    if not name:
        raise ValueError("the name is empty: type a name (up to 24 characters)")
    if len(name) > MAX_NAME:
        raise ValueError(f"the name is too long ({len(name)} characters; the limit is {MAX_NAME})")
    if MARKUP.search(name):
        raise ValueError("the name cannot contain markup characters (< > & \" ' `)")
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        raise ValueError("the name cannot contain control characters")
    return name


class Room:
    def __init__(self, reserved: list[str] = ()):
        self.slots: dict[str, int] = {}          # label -> slot, in order of first sight
        self._taken: set[str] = set()            # casefolded labels: a new student's label must avoid these
        self.members: dict[str, Member] = {}     # token -> member
        self._cursor = 0                         # stream records already read by learn()
        for label in reserved:
            self.slot(label)

    def slot(self, label: str) -> int | None:
        if label not in self.slots and len(self.slots) < MAX_SLOTS:
            self.slots[label] = len(self.slots)
            self._taken.add(label.casefold())
        return self.slots.get(label)

    def unique(self, name: str) -> str:
        label, n = name, 1
        while label.casefold() in self._taken:
            n += 1
            label = f"{name} {n}"
        return label

    def join(self, name, token: str | None = None) -> Member:
        """A new member, or (with the token of one) the same member under a new name."""
        name = check_name(name)
        member = self.members.get(token) if token else None
        if member is not None and member.label.casefold() == name.casefold():
            return member
        if member is None and len(self.members) >= MAX_MEMBERS:
            raise ValueError(f"the room is full ({MAX_MEMBERS} people)")
        label = self.unique(name)
        self.slot(label)
        self._taken.add(label.casefold())        # even when the slots have run out
        if member is None:
            member = Member(secrets.token_urlsafe(18), label)
            self.members[member.token] = member
        else:
            member.label = label
        return member

    def leave(self, token: str | None) -> Member | None:
        """Take a member out of the room; their streaming reply, if any, is closed (aborted in the engine).
        The label stays taken and keeps its slot: the chart may still show their rows."""
        member = self.members.pop(token, None) if token else None
        if member is not None and member.stream is not None:
            member.stream.close("the student left the room")
        return member

    def member(self, token: str | None) -> Member | None:
        return self.members.get(token) if token else None

    def suggest(self) -> str:
        """A friendly free name, for the join box."""
        for _ in range(50):
            name = f"{random.choice(ADJECTIVES)} {random.choice(ANIMALS)}"
            if name.casefold() not in self._taken:
                return name
        return self.unique(f"{random.choice(ADJECTIVES)} {random.choice(ANIMALS)}")

    def learn(self, ring):
        """Number the labels of requests that arrived on the stream since the last call."""
        head = ring.head
        for entry in ring.read(self._cursor, head):
            obj = entry.obj
            if obj.get("type") == "request" and obj.get("event") == "arrived" and obj.get("label"):
                self.slot(str(obj["label"]))
        self._cursor = head


def lan_address() -> str:
    """This machine's address on its network: the source address of a route out (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))           # TEST-NET-1: never routed, only looked up
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def join_url(host: str, port: int, public_url: str | None, base_url: str) -> str:
    """The address students type: --public-url when set; the LAN address when listening on every
    interface; otherwise the address this page was reached at (base_url)."""
    if public_url:
        return public_url.rstrip("/") + "/join"
    if host in ("0.0.0.0", "::", ""):
        return f"http://{lan_address()}:{port}/join"
    return base_url.rstrip("/") + "/join"
