// Package peertls gives an agent its identity among its peers: a short-lived
// TLS certificate for its node name, signed by the cluster's CA, minted at
// start and renewed before it expires, and the TLS 1.3 configurations that
// require and verify such a certificate on both ends of a peer connection.
// Certificates and CA bundles are swapped in place as they change, so
// neither a renewal nor a CA rotation needs a restart.
package peertls
