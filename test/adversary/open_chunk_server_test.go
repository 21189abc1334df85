package adversary

// Attack 2, open chunk server: the agent's chunk server (:7947, on the
// host network) spoke plain HTTP to anyone. Whoever reached a node's
// address downloaded any cached blob by its digest (image digests are
// public in node.status.images) and read how a reference resolved at
// /v1/resolutions/<sha256 of the reference>, a guessable key.

import (
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

func TestOpenChunkServer(t *testing.T) {
	t.Parallel()
	const secret = "team A's private weights, fine-tuned on their customers' data"
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	hub.AddRepo("team-a/private", map[string]hubtest.Content{
		"config.json":       hubtest.String(`{"model_type":"llama"}`),
		"model.safetensors": hubtest.String(secret),
	})
	sum := sha256.Sum256([]byte(secret))
	blob := "sha256:" + hex.EncodeToString(sum[:])
	r, err := ref.Parse("hf://team-a/private@main")
	require.NoError(t, err)
	key := sha256.Sum256([]byte(r.String()))
	paths := map[string]string{
		"the blob by its digest":    fmt.Sprintf("/v1/blobs/%s/chunks/0", blob),
		"the blob's chunk state":    fmt.Sprintf("/v1/blobs/%s/state", blob),
		"the resolution of its ref": "/v1/resolutions/" + hex.EncodeToString(key[:]),
	}

	// The agent is started as the chart starts it: with the cluster CA
	// mounted and named in its environment.
	cluster, err := peertls.WriteCA(t.TempDir(), "weightd cluster CA")
	require.NoError(t, err)
	addr := freeAddr(t)
	a := startAgentProc(t, nil, []string{"WEIGHTD_PEER_CA_FILE=" + cluster.CA, "WEIGHTD_PEER_CA_KEY_FILE=" + cluster.Key,
		"WEIGHTD_FETCH_ALLOW_CIDRS=127.0.0.1/32"}, // the hub listens on loopback
		"--no-load-trace", "--node-name", "node-a", "--gossip-addr", "127.0.0.1:0", "--chunk-addr", addr, "--hf-endpoint", hub.URL)
	a.waitReady(t)
	st := a.fetch(t, r.String())
	require.Equal(t, prefetch.StateReady, st.State, st.Error)

	// Outsiders: anything on the node network, without a certificate or
	// with one from another CA (another cluster's, or its own).
	other, err := peertls.WriteCA(t.TempDir(), "another CA")
	require.NoError(t, err)
	impostor, err := peertls.New("node-b", other)
	require.NoError(t, err)
	noCert := &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12} // an outsider takes any server
	otherCA := impostor.ClientConfig()
	otherCA.VerifyConnection = nil // it does not care who the server is
	outsiders := []struct {
		name string
		url  string
		tls  *tls.Config
	}{
		{"plain HTTP", "http://", nil},
		{"TLS without a client certificate", "https://", noCert},
		{"TLS with a certificate from another CA", "https://", otherCA},
	}
	for _, o := range outsiders {
		for what, p := range paths {
			body, code, err := get(o.tls, o.url+addr+p)
			if err == nil && (code == http.StatusOK || code == http.StatusPartialContent || strings.Contains(body, secret)) {
				t.Errorf("an outsider over %s read %s (%s): %d, %d bytes: %.80q", o.name, what, p, code, len(body), body)
			}
		}
	}

	// A peer of the cluster, holding a certificate its CA signed, gets
	// all of it: the guard above is not a server that answers no one.
	peer, err := peertls.New("node-b", cluster)
	require.NoError(t, err)
	body, code, err := get(peer.ClientConfig(), "https://"+addr+paths["the blob by its digest"])
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, secret, body)
	body, code, err = get(peer.ClientConfig(), "https://"+addr+paths["the resolution of its ref"])
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "team-a/private")
}

// get GETs url and returns the answer's body and status, or the error of
// a connection refused.
func get(cfg *tls.Config, url string) (string, int, error) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
	defer c.CloseIdleConnections()
	resp, err := c.Get(url)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), resp.StatusCode, err
}
