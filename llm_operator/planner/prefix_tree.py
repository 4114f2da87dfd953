"""Compressed token trie over a batch of prompts, built without touching tokens in Python.

Each prompt is encoded as big-endian uint32 bytes, so bytes order (memcmp) is token order and
a shared token prefix is a shared byte prefix at a multiple of 4. Sorting the encodings puts
the prompts in depth-first order of the trie; the longest common prefix (LCP) of each sorted
neighbour pair then gives the branch depths, and one stack pass over (sorted prompt, LCP)
builds the compressed tree. Python work is O(prompts * log(prompt length)); the per-token
work happens in C (array conversion, sorting, bytes slicing and comparison).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT = 0
"""Node id of the trie root (depth 0, holds no tokens)."""

_BYTES_PER_TOKEN = 4
_MAX_TOKEN_ID = 2**32 - 1
_LITTLE_ENDIAN = sys.byteorder == "little"


def encode_prompt(row: int, token_ids: Sequence[int]) -> bytes:
    """Encode one prompt as big-endian uint32 bytes.

    ``row`` only names the prompt in error messages. Raises TypeError when the prompt does not
    hold integers and ValueError when a token id lies outside [0, 2**32).
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise TypeError(
                f"token_ids[{row}] must be a 1-D sequence of ints, got an array of "
                f"shape {token_ids.shape} and dtype {token_ids.dtype}"
            )
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > _MAX_TOKEN_ID):
            raise ValueError(f"token_ids[{row}] holds a token id outside [0, 2**32)")
        return token_ids.astype(">u4").tobytes()
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"token_ids[{row}] must be a sequence of ints, got {type(token_ids)}")
    try:
        encoded = array.array("I", token_ids)
    except OverflowError:
        raise ValueError(f"token_ids[{row}] holds a token id outside [0, 2**32)") from None
    except TypeError:
        raise TypeError(
            f"token_ids[{row}] must be a sequence of ints, got {type(token_ids).__name__} "
            f"{str(token_ids)[:60]}"
        ) from None
    assert encoded.itemsize == _BYTES_PER_TOKEN, "array('I') must hold 4-byte unsigned ints"
    if _LITTLE_ENDIAN:
        encoded.byteswap()
    return encoded.tobytes()


def common_prefix_tokens(first: bytes, second: bytes, guess: int = 0) -> int:
    """Length in tokens of the longest common prefix of two encoded prompts.

    ``guess`` (any int) is a likely answer, such as the previous neighbour pair's: when right,
    it costs three bytes comparisons instead of a full binary search.
    """
    limit = min(len(first), len(second)) // _BYTES_PER_TOKEN
    if first[: limit * _BYTES_PER_TOKEN] == second[: limit * _BYTES_PER_TOKEN]:
        return limit
    # Invariant: the first `low` tokens agree, the first `high` tokens do not.
    low, high = 0, limit
    if 0 < guess < limit:
        cut = guess * _BYTES_PER_TOKEN
        if first[:cut] == second[:cut]:
            low = guess
            if first[cut : cut + _BYTES_PER_TOKEN] != second[cut : cut + _BYTES_PER_TOKEN]:
                return guess
            low = guess + 1
        else:
            high = guess
    while high - low > 1:
        middle = (low + high) // 2
        # Tokens before `low` are known to agree: compare only [low, middle).
        begin, cut = low * _BYTES_PER_TOKEN, middle * _BYTES_PER_TOKEN
        if first[begin:cut] == second[begin:cut]:
            low = middle
        else:
            high = middle
    return low


def sort_with_common_prefixes(keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
    """Sort encoded prompts; return (order, lcp).

    ``order`` lists prompt indices in token order (ties keep index order); ``lcp[i]`` is the
    common prefix length in tokens of prompts ``order[i - 1]`` and ``order[i]`` (0 for i = 0).
    """
    order = sorted(range(len(keys)), key=keys.__getitem__)
    lcp = [0] * len(order)
    previous = 0
    for position in range(1, len(order)):
        previous = common_prefix_tokens(keys[order[position - 1]], keys[order[position]], previous)
        lcp[position] = previous
    return order, lcp


def count_unique_tokens(keys: Sequence[bytes]) -> int:
    """Number of distinct non-empty token prefixes over all prompts (the trie's token count)."""
    order, lcp = sort_with_common_prefixes(keys)
    return sum(len(keys[prompt]) // _BYTES_PER_TOKEN for prompt in order) - sum(lcp)


@dataclass(frozen=True)
class PrefixTree:
    """A compressed token trie; nodes are ints, ``ROOT`` is node 0.

    A node spans tokens ``[depth[parent[node]], depth[node])`` of every prompt below it.
    Every node but the root has at least two children-or-terminals, or is a leaf with
    terminals. ``terminals[node]`` lists the prompts that end exactly at the node (several
    when prompts are identical); every prompt is a terminal of exactly one node.
    """

    depth: list[int]
    parent: list[int]
    children: list[list[int]]
    terminals: list[list[int]]
    first_prompt: list[int]
    """Some prompt below the node (root: -1), to read the node's tokens from."""
    unique_tokens: int

    def preorder(self) -> list[int]:
        """Node ids with each parent before its children (children in token order)."""
        visited: list[int] = []
        pending = [ROOT]
        while pending:
            node = pending.pop()
            visited.append(node)
            pending.extend(reversed(self.children[node]))
        return visited


def build_prefix_tree(keys: Sequence[bytes]) -> PrefixTree:
    """Build the compressed trie of the encoded prompts ``keys`` (see ``encode_prompt``)."""
    order, lcp = sort_with_common_prefixes(keys)
    depth = [0]
    parent = [-1]
    children: list[list[int]] = [[]]
    terminals: list[list[int]] = [[]]
    first_prompt = [-1]
    # Stack: the path from the root to the node of the previous prompt, depths increasing.
    path = [ROOT]
    unique_tokens = 0
    for position, prompt in enumerate(order):
        shared = lcp[position]
        length = len(keys[prompt]) // _BYTES_PER_TOKEN
        unique_tokens += length - shared
        popped = -1
        while depth[path[-1]] > shared:
            popped = path.pop()
        top = path[-1]
        if depth[top] < shared:
            # The previous prompt's branch continues past `shared`: split its edge there.
            assert popped >= 0 and children[top][-1] == popped, "split must hit the last child"
            middle = len(depth)
            depth.append(shared)
            parent.append(top)
            children.append([popped])
            terminals.append([])
            first_prompt.append(first_prompt[popped])
            children[top][-1] = middle
            parent[popped] = middle
            path.append(middle)
            top = middle
        if length == shared:
            terminals[top].append(prompt)
            continue
        leaf = len(depth)
        depth.append(length)
        parent.append(top)
        children.append([])
        terminals.append([prompt])
        first_prompt.append(prompt)
        children[top].append(leaf)
        path.append(leaf)
    return PrefixTree(depth, parent, children, terminals, first_prompt, unique_tokens)
