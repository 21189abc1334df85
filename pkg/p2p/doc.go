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
package p2p
