// Command kindnetd is a minimal stand-in for kind's kindnetd (whose module the Go proxy
// here does not serve): the pod network of a kind cluster whose nodes share one docker
// network. Every few seconds it reads the nodes from the API server and
//
//   - writes this node's CNI config: ptp veth pairs, host-local addresses from the
//     node's podCIDR, portmap for hostPort;
//   - routes every other node's podCIDR via that node's InternalIP;
//   - masquerades traffic from pods to anything outside the pod network.
//
// It needs NODE_NAME and POD_SUBNET; CONTROL_PLANE_ENDPOINT (host:port, set by kind)
// lets it reach the API server before kube-proxy programs the service address.
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

const (
	saDir    = "/var/run/secrets/kubernetes.io/serviceaccount"
	cniFile  = "/etc/cni/net.d/10-kindnet.conflist"
	interval = 3 * time.Second
)

type nodeList struct {
	Items []struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
		Spec struct {
			PodCIDRs []string `json:"podCIDRs"`
		} `json:"spec"`
		Status struct {
			Addresses []struct {
				Type    string `json:"type"`
				Address string `json:"address"`
			} `json:"addresses"`
		} `json:"status"`
	} `json:"items"`
}

func main() {
	log.SetFlags(log.LstdFlags | log.Lmsgprefix)
	log.SetPrefix("kindnetd: ")
	nodeName, podSubnet := os.Getenv("NODE_NAME"), os.Getenv("POD_SUBNET")
	if nodeName == "" || podSubnet == "" {
		log.Fatal("NODE_NAME and POD_SUBNET must be set")
	}
	client, url := apiClient()
	masquerade(podSubnet)
	routes := map[string]string{} // podCIDR -> gateway, as installed
	written := ""
	for ; ; time.Sleep(interval) {
		nodes, err := listNodes(client, url)
		if err != nil {
			log.Printf("listing nodes: %v", err)
			continue
		}
		seen := map[string]bool{}
		for _, n := range nodes.Items {
			if len(n.Spec.PodCIDRs) == 0 {
				continue
			}
			if n.Metadata.Name == nodeName {
				if conf := cniConfig(n.Spec.PodCIDRs[0]); conf != written {
					if err := writeFile(cniFile, conf); err != nil {
						log.Printf("writing %s: %v", cniFile, err)
						continue
					}
					written = conf
					log.Printf("CNI config for %s written", n.Spec.PodCIDRs[0])
				}
				continue
			}
			gw := ""
			for _, a := range n.Status.Addresses {
				if a.Type == "InternalIP" && !strings.Contains(a.Address, ":") {
					gw = a.Address
				}
			}
			for _, cidr := range n.Spec.PodCIDRs {
				if gw == "" || strings.Contains(cidr, ":") {
					continue
				}
				seen[cidr] = true
				if routes[cidr] == gw {
					continue
				}
				if err := run("ip", "route", "replace", cidr, "via", gw); err != nil {
					log.Printf("route %s via %s: %v", cidr, gw, err)
					continue
				}
				routes[cidr] = gw
				log.Printf("route %s via %s (%s)", cidr, gw, n.Metadata.Name)
			}
		}
		for cidr := range routes { // nodes that left the cluster
			if !seen[cidr] {
				_ = run("ip", "route", "del", cidr)
				delete(routes, cidr)
				log.Printf("route %s removed", cidr)
			}
		}
	}
}

// apiClient authenticates with the pod's service account token.
func apiClient() (*http.Client, string) {
	ca, err := os.ReadFile(filepath.Join(saDir, "ca.crt"))
	if err != nil {
		log.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	host := os.Getenv("CONTROL_PLANE_ENDPOINT")
	if host == "" {
		host = os.Getenv("KUBERNETES_SERVICE_HOST") + ":" + os.Getenv("KUBERNETES_SERVICE_PORT")
	}
	return &http.Client{
		Timeout:   10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}, "https://" + host + "/api/v1/nodes"
}

func listNodes(client *http.Client, url string) (*nodeList, error) {
	token, err := os.ReadFile(filepath.Join(saDir, "token")) // rotated by the kubelet
	if err != nil {
		return nil, err
	}
	req, _ := http.NewRequest("GET", url, nil)
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	var nodes nodeList
	return &nodes, json.NewDecoder(resp.Body).Decode(&nodes)
}

func cniConfig(podCIDR string) string {
	conf := map[string]any{
		"cniVersion": "0.4.0",
		"name":       "kindnet",
		"plugins": []any{
			map[string]any{
				"type":   "ptp",
				"ipMasq": false,
				"ipam": map[string]any{
					"type":   "host-local",
					"ranges": [][]map[string]string{{{"subnet": podCIDR}}},
					"routes": []map[string]string{{"dst": "0.0.0.0/0"}},
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}
	out, _ := json.MarshalIndent(conf, "", "  ")
	return string(out) + "\n"
}

// masquerade installs, once, a nat rule that hides pod addresses behind the node's
// address for traffic leaving the pod network (the docker network's DNS and gateway).
func masquerade(podSubnet string) {
	const chain = "KINDNET-MASQ"
	_ = run("iptables", "-w", "-t", "nat", "-N", chain) // exists after a restart
	steps := [][]string{
		{"-F", chain},
		{"-A", chain, "-d", podSubnet, "-j", "RETURN"},
		{"-A", chain, "-m", "addrtype", "--dst-type", "LOCAL", "-j", "RETURN"},
		{"-A", chain, "-j", "MASQUERADE"},
	}
	for _, s := range steps {
		if err := run("iptables", append([]string{"-w", "-t", "nat"}, s...)...); err != nil {
			log.Fatalf("iptables %v: %v", s, err)
		}
	}
	jump := []string{"POSTROUTING", "-s", podSubnet, "-j", chain}
	if run("iptables", append([]string{"-w", "-t", "nat", "-C"}, jump...)...) != nil {
		if err := run("iptables", append([]string{"-w", "-t", "nat", "-A"}, jump...)...); err != nil {
			log.Fatalf("iptables: %v", err)
		}
	}
}

func writeFile(path, content string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func run(name string, args ...string) error {
	var stderr bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}
