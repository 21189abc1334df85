// Package p2p is peer-to-peer sharing between weightd agents: membership,
// content routing, chunk server and swarm downloader.
//
// Membership runs hashicorp/memberlist gossip among the agents of a cluster:
// who is alive, each node's metadata (chunk-server address, zone, free disk,
// version), and small events, "I hold blob D, complete or partial" and "I
// dropped it". A Router turns those events, and each peer's full list of
// holdings exchanged in memberlist's push/pull, into the answer to "who holds
// D?". Chunk bytes never ride on gossip: they come from the peers' chunk
// servers.
//
// Gossip is encrypted and authenticated with a shared keyring; a node
// without a key of the cluster can neither join it nor read its gossip, and
// everything decoded from the network is checked before use.
//
// # The swarm downloader
//
// A Swarm fills one blob (a fill) chunk by chunk from the peers that hold
// it and from the origin. Membership and holders: the fill follows holders
// the Directory names (at most MaxFollowed, below), and also asks the members ranked first for
// the blob (below) directly, since gossip can miss a holder. Of each it
// reads the chunk state (PeerState: chunks verified and their hashes,
// chunks on their way to it, chunks it already sent, whether it fetches
// from the origin) at most once per Refresh, or per an eighth of a chunk's
// time where chunks come faster (fast links); a read waits at the holder
// until it has news. A member that holds none of the blob is not asked
// again for a while; one that leaves the cluster is dropped after a grace.
//
// Origin election: only OriginFetchers nodes (default 2) fetch a blob from
// the origin, so the origin serves about one copy. Every node ranks itself
// and every holder gossip names by rendezvous hashing (FNV-1a of digest and
// name, then MurmurHash3's finalizer), spread over zones (below): all
// compute the same order, and removing a name keeps the others'.
// No node takes the role while a peer holds the blob whole, or while
// OriginFetchers peers already say they fetch it. A node takes it at its
// turn, Settle times one plus its rank past the first OriginFetchers, after
// its fill began; at once when it is alone or among the first
// OriginFetchers of all live members, as none can rank above it. It waits
// while holders' states are still unread, within reason. One that waited
// for its turn lets peers see it fetch, and asks the origin, only once the
// followed peers ranked above it have answered a state read sent after it
// took the role (or a state read's wait passed): word, not a timer, as a
// busy node's answers lag by more than Settle. When more nodes took the
// role, one with OriginFetchers fetchers ranked above it yields.
//
// Origin shares: the fetchers split the chunks: chunk i is share i mod the
// number of fetchers, in rendezvous order (a first member that may have
// taken the role counts for Settle, then until its word says otherwise:
// that it holds none, or, once it can no longer be waiting on holders'
// states, that it fills the blob but does not fetch);
// each fetches the lowest chunk of its share that no peer has or receives,
// and once done helps the fetcher with the most left from the back of
// that share. It keeps 3 requests in flight to the origin while the fill
// is its node's only one, 2 beside others (originRequests), and while it
// has origin work left only a few to peers. The origin is never banned: a
// slow answer is no failure, others back off, and the fill gives up only
// on a permanent error, or after repeated failures and half a minute
// without a byte. Peers still see the role for OriginLinger after the fill
// ends, but not after a node yields it. A blob of one chunk up to 1 MiB
// skips all this: a complete holder, else the origin.
//
// Origin limits: OriginLimit caps what each origin (a registry, the hub,
// the object store; Origin.Name) sends the whole cluster, OriginLimits
// sets it per origin, with no central component. An origin's limit is
// split evenly among the cluster's (blob, origin fetcher) pairs of that
// origin, and each node paces its reads of the origin (chunks, small
// blobs, streams) at the parts of its own pairs; one that fetches nothing
// for the cluster counts as one pair. A node counts the pairs its fills
// see and those the members gossip (NodeMeta.OriginFetches, per origin,
// which counts blobs filled by other nodes too), and takes the larger
// (originlimit.go). A member's fetches of origins it does not name (past
// the 7 it fetches most from, or all of an older agent's) count against
// every origin.
//
// Following: a fill reads the chunk states of, and asks for chunks, at
// most MaxFollowed holders: the first in election order, complete ones,
// then others at random, its zone's first, and every two seconds it drops
// the one with least of what it misses for another (follow.go). State
// reads then cost each node the same however large the cluster.
//
// Chunk picking: at most MaxInFlight requests per fill (and 128 MiB of
// chunks; all fills of a node together 512 MiB, but two each always), at
// most PerPeer to one peer over all fills. Origin requests go
// first; then the lowest missing chunk from the byte a reader waits on
// (Want); then the rarest missing chunk, among equally rare ones first one
// its supplier has not yet sent to anyone, then, for a blob a reader
// streams, the first. A chunk whose only holder already sent it is left a
// while (holdoff) for the receiver to pass on. Among suppliers, a node
// still filling the blob beats one holding it whole (but for the endgame),
// then one holding the chunk unsent beats one receiving it, which beats
// one that sent it; then the least loaded. An origin fetcher is asked
// again for a chunk it sent only when no other supplier is free, and for
// 10 s after a chunk's first send it sends one such repeat at a time while
// half its upload slots are free, then to all who ask (a window that
// opened again could be held by whoever asks the moment it closes). Its
// refusal names the member it sent the chunk to, whom the refused fill
// then follows; one that has banned that member, or finds it gone, asks
// the fetcher to send the chunk again, and becomes the receiver.
// A holder of the whole blob, while over half its upload slots are held,
// refuses a chunk it is sending to a member whose send moves at a fair
// pace (SendsOnce): that member relays it, and the holder's upload goes to
// the chunks only it has.
// A holder's upload slots are held by its uploads but those whose reader
// has taken a second (on a fast uplink, its chunk's time at that pace) at
// under half a slot's share of the uplink: those lend theirs (SlotsHeld),
// up to twice the slots in all, so that a slow node's requests do not
// keep the holder's link idle.
// Endgame: once every missing chunk is asked for and no more are left than
// the fill's request limit, each may get one duplicate request to another
// peer than the first; those still running when the blob is complete are
// cancelled. None while the node fills other blobs too, whose chunks share
// its downlink.
//
// Zones: each node tells its zone (NodeMeta.Zone; "" without one, all
// such nodes one zone). The election's order puts each zone's first node
// in rendezvous order before any zone's second, so the origin fetchers lie
// in as many zones as there are. A supplier in this node's zone beats any
// outside it, whatever its class. A chunk that only nodes outside the zone
// have or receive crosses into it through one node, the zone's entry for
// it: the first for the chunk, by rendezvous hashing, of the zone's nodes
// that gossip names as filling the blob (in the fill's first Settle, of
// the zone's members); it asks for such chunks before any other, as its
// zone waits on them. The k-th node in the chunk's order crosses after k
// holdoffs of the chunk outside the zone only (views differ: the entry
// may be gone, or not know it is one); the chunk's first three cross past
// a zone copy that they gave up as too slow or that has only been on its
// way for long; the last chunks (endgame) cross at once, but for
// duplicates of chunks the zone has. A blob so enters each zone about
// once.
//
// Relays: a node receiving a chunk says so in its state, and its chunk
// server passes the chunk on while it arrives, piece by piece, holding back
// the last piece until the chunk is verified and written here; the hash
// follows in a trailer. A chunk so crosses the swarm in about one transfer
// time however many hops it takes. A relay cut short is not its fault.
//
// Hash trust: a chunk from a holder must match the hash an origin fetcher
// other than the sender advertises (it hashed the origin's bytes), else the
// sender's own. A relayed chunk is checked once it has come: against an
// origin fetcher's hash if one shows in that fetcher's state within a
// second, else against the relay's word (its trailer or state).
//
// Bans and repair: a peer that sends a chunk that does not match, a state
// that does not fit the blob, or fails three times in a row is banned for
// BanFor; a busy or slow peer is only asked less for a while. After the
// last chunk the whole blob is checked against its digest; should a wrong
// chunk map have let bad chunks in, every chunk from a peer is fetched
// again from the origin, the peers whose chunks differ are banned, and the
// blob is checked again.
//
// Stall watchdog: a request to a peer has a deadline of a few seconds plus
// the chunk at MinRate for each blob the node fills at once (four times
// that for a relayed copy, which comes at its upstream's pace), and a
// transfer ends sooner once no byte has come for five seconds; one that
// brought bytes too slowly marks its peer slow, not failing. A copy from a
// peer that two seconds on comes at under a sixteenth of this node's
// measured downlink is given up the same way, and asked elsewhere
// (CopyTooSlow), twice per chunk at most, never an origin fetcher's, and
// not while the node fills several blobs, whose copies share its downlink.
// A request to the origin has no deadline, only the stall:
// cutting a busy origin's slow transfer would cost its bytes again.
// DownloadLimit paces all transfers together, streams from the origin
// outside the swarm included (Paced).
package p2p
