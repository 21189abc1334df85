package services

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The token server's names, as the registry's config and the tokens carry
// them.
const (
	tokenService = "weightd-test-registry"
	tokenIssuer  = "weightd-test-token-server"
	tokenTTL     = 10 * time.Minute
)

// tokenServer implements the Docker registry token protocol
// (https://distribution.github.io/distribution/spec/auth/token/) for one user:
// GET with HTTP basic credentials, or the OAuth2 password grant by POST,
// returns a JWT granting the actions asked for. Tokens are ES256, signed by a
// self-signed certificate carried in the x5c header and written to bundle,
// the registry's rootcertbundle.
type tokenServer struct {
	user   string
	bundle string
	srv    *http.Server
	ln     net.Listener

	mu      sync.Mutex // pass, key and certDER change on rotate
	pass    string
	key     *ecdsa.PrivateKey
	certDER []byte
}

func startTokenServer(dir, user, pass string) (*tokenServer, error) {
	bundle := filepath.Join(dir, "token-root.pem")
	key, der, err := newTokenKey(bundle)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("token server: %w", err)
	}
	t := &tokenServer{user: user, pass: pass, key: key, certDER: der, bundle: bundle, ln: ln}
	t.srv = &http.Server{Handler: http.HandlerFunc(t.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = t.srv.Serve(ln) }()
	return t, nil
}

// rotate takes a new password and a new signing key, written to bundle:
// the registry, restarted, refuses every token signed before.
func (t *tokenServer) rotate(pass string) error {
	key, der, err := newTokenKey(t.bundle)
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.pass, t.key, t.certDER = pass, key, der
	return nil
}

// newTokenKey makes a signing key and its self-signed certificate, and
// writes the certificate to bundle.
func newTokenKey(bundle string) (*ecdsa.PrivateKey, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: tokenIssuer},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("token server certificate: %w", err)
	}
	if err := os.WriteFile(bundle, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, err
	}
	return key, der, nil
}

// realm is the token endpoint's URL. It names the host "localhost", not
// 127.0.0.1: go-containerregistry refuses a realm that is a loopback or
// private IP literal on another port than the registry's (an SSRF guard).
func (t *tokenServer) realm() string {
	return "http://" + net.JoinHostPort("localhost", strconv.Itoa(t.ln.Addr().(*net.TCPAddr).Port)) + "/token"
}

func (t *tokenServer) close() { _ = t.srv.Close() }

func (t *tokenServer) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/token" {
		http.NotFound(w, r)
		return
	}
	var (
		user, pass string
		ok         bool
		scopes     []string
	)
	switch r.Method {
	case http.MethodGet:
		user, pass, ok = r.BasicAuth()
		scopes = r.URL.Query()["scope"]
	case http.MethodPost: // OAuth2 password grant, as containerd tries first
		if err := r.ParseForm(); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if r.PostForm.Get("grant_type") != "password" {
			http.Error(w, "unsupported grant_type", http.StatusBadRequest)
			return
		}
		user, pass, ok = r.PostForm.Get("username"), r.PostForm.Get("password"), true
		for _, s := range r.PostForm["scope"] {
			scopes = append(scopes, strings.Fields(s)...)
		}
	default:
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	if !ok || !t.valid(user, pass) {
		w.Header().Set("WWW-Authenticate", `Basic realm="weightd test registry"`)
		http.Error(w, "authentication required", http.StatusUnauthorized)
		return
	}
	if svc := r.FormValue("service"); svc != "" && svc != tokenService {
		http.Error(w, "unknown service", http.StatusBadRequest)
		return
	}
	tok, err := t.sign(user, scopes)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"token":        tok,
		"access_token": tok,
		"expires_in":   int(tokenTTL.Seconds()),
		"issued_at":    time.Now().UTC().Format(time.RFC3339),
	})
}

func (t *tokenServer) valid(user, pass string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	u := subtle.ConstantTimeCompare([]byte(user), []byte(t.user))
	p := subtle.ConstantTimeCompare([]byte(pass), []byte(t.pass))
	return u&p == 1
}

type resourceActions struct {
	Type    string   `json:"type"`
	Name    string   `json:"name"`
	Actions []string `json:"actions"`
}

// parseScope parses "repository:name:pull,push"; the name may contain
// colons (a registry host with a port), the type and actions may not.
func parseScope(s string) (resourceActions, error) {
	i, j := strings.IndexByte(s, ':'), strings.LastIndexByte(s, ':')
	if i < 0 || i == j {
		return resourceActions{}, fmt.Errorf("malformed scope %q", s)
	}
	ra := resourceActions{Type: s[:i], Name: s[i+1 : j]}
	for a := range strings.SplitSeq(s[j+1:], ",") {
		if a != "" {
			ra.Actions = append(ra.Actions, a)
		}
	}
	return ra, nil
}

// sign returns a JWT for user granting every scope asked for.
func (t *tokenServer) sign(user string, scopes []string) (string, error) {
	access := []resourceActions{}
	for _, s := range scopes {
		ra, err := parseScope(s)
		if err != nil {
			return "", err
		}
		access = append(access, ra)
	}
	now := time.Now()
	t.mu.Lock()
	key, certDER := t.key, t.certDER
	t.mu.Unlock()
	header := map[string]any{
		"typ": "JWT",
		"alg": "ES256",
		"x5c": []string{base64.StdEncoding.EncodeToString(certDER)},
	}
	claims := map[string]any{
		"iss":    tokenIssuer,
		"sub":    user,
		"aud":    tokenService,
		"exp":    now.Add(tokenTTL).Unix(),
		"nbf":    now.Add(-time.Minute).Unix(),
		"iat":    now.Unix(),
		"jti":    randomHex(16),
		"access": access,
	}
	hb, err := json.Marshal(header)
	if err != nil {
		return "", err
	}
	cb, err := json.Marshal(claims)
	if err != nil {
		return "", err
	}
	enc := base64.RawURLEncoding
	signed := enc.EncodeToString(hb) + "." + enc.EncodeToString(cb)
	sum := sha256.Sum256([]byte(signed))
	r, s, err := ecdsa.Sign(rand.Reader, key, sum[:])
	if err != nil {
		return "", err
	}
	// JWS ES256: r and s as 32-byte big-endian integers, concatenated.
	sig := make([]byte, 64)
	r.FillBytes(sig[:32])
	s.FillBytes(sig[32:])
	return signed + "." + enc.EncodeToString(sig), nil
}
